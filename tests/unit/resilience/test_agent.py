"""The node agent's side of IMDSv2, against the fake metadata service on 127.0.0.1 (no Ray).

The drain itself, on a real multi-node Ray cluster, is tests/integration/test_agent_drain.py.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

import pytest

from tests.support.imds import REBALANCE_PATH, SPOT_PATH, TOKEN_PATH, FakeImds
from trainer.resilience import agent


@pytest.fixture
def imds():
    with FakeImds() as fake:
        yield fake


def test_fake_refuses_a_get_without_a_session_token(imds: FakeImds) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(imds.endpoint + SPOT_PATH, timeout=2)
    assert err.value.code == 401
    req = urllib.request.Request(imds.endpoint + TOKEN_PATH, method="PUT")  # no TTL header
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=2)
    assert err.value.code == 400


def test_client_gets_a_token_first_and_sends_it(imds: FakeImds) -> None:
    client = agent.ImdsClient(imds.endpoint)
    assert client.get(SPOT_PATH) is None  # 404 until triggered
    notice_time = imds.trigger_spot(120, action="stop")
    body = json.loads(client.get(SPOT_PATH))
    assert body == {"action": "stop", "time": notice_time.strftime("%Y-%m-%dT%H:%M:%SZ")}
    methods = [(r.method, r.path) for r in imds.requests]
    assert methods == [("PUT", TOKEN_PATH), ("GET", SPOT_PATH), ("GET", SPOT_PATH)]
    assert all(r.token and r.status != 401 for r in imds.requests_to(SPOT_PATH))


def test_client_renews_a_token_the_service_forgot(imds: FakeImds) -> None:
    client = agent.ImdsClient(imds.endpoint)
    client.get(SPOT_PATH)
    imds.expire_tokens()
    assert client.get(SPOT_PATH) is None
    statuses = [(r.method, r.status) for r in imds.requests]
    assert statuses == [("PUT", 200), ("GET", 404), ("GET", 401), ("PUT", 200), ("GET", 404)]


def test_client_renews_a_token_before_it_expires(imds: FakeImds, monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(agent.time, "monotonic", lambda: clock[0])
    client = agent.ImdsClient(imds.endpoint, ttl_s=600)
    client.get(SPOT_PATH)
    clock[0] += 600 - agent.TOKEN_REFRESH_S - 1  # still inside the token's safe life
    client.get(SPOT_PATH)
    assert len(imds.requests_to(TOKEN_PATH, "PUT")) == 1
    clock[0] += 2  # less than TOKEN_REFRESH_S left: renewed before the service would refuse
    client.get(SPOT_PATH)
    assert len(imds.requests_to(TOKEN_PATH, "PUT")) == 2
    assert not [r for r in imds.requests if r.status == 401]


def test_poll_survives_the_service_being_down_and_logs_it_once(
    imds: FakeImds, caplog, tmp_path
) -> None:
    caplog.set_level(logging.INFO, logger="raylift.agent")
    notice = tmp_path / "rebalance.json"
    options = agent.AgentOptions(
        imds_endpoint=imds.endpoint, interval_s=0.1, rebalance_file=str(notice)
    )
    a = agent.Agent(options)
    a.poll_once()
    with imds.down():
        a.poll_once()
        a.poll_once()
    a.poll_once()
    imds.trigger_rebalance()
    a.poll_once()
    a.poll_once()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("metadata service unreachable" in line for line in lines) == 1
    assert sum("answers again" in line for line in lines) == 1
    rebalance = [line for line in lines if line.startswith("rebalance recommendation")]
    assert len(rebalance) == 1 and "intervals shorten" in rebalance[0]
    assert json.loads(notice.read_text())["noticeTime"]  # for the node's training ranks
    assert len(imds.requests_to(REBALANCE_PATH)) == 4  # polled again after the outage


def test_cli_refuses_bad_numbers_with_exit_2(capsys) -> None:
    from trainer.__main__ import main

    with pytest.raises(SystemExit) as err:
        main(["agent", "--margin", "-1"])
    assert err.value.code == 2
    assert "--margin: must be >= 0" in capsys.readouterr().err
