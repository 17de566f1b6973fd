"""Stand-ins for the `aws` and `pulumi` CLIs (AWS is not reachable from tests): written as
executables onto a PATH folder. `aws ssm start-session` really forwards its local port, to
the local test cluster's dashboard on 127.0.0.1, the way the session-manager-plugin
forwards to the head; every call is recorded in calls.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HEAD_INSTANCE = "i-0123456789abcdef0"
ASG = "raylift-test-head-20260101"
SECRET_ARN = "arn:aws:secretsmanager:eu-west-1:123456789012:secret:raylift-token-AbCd"

AWS = r"""
import asyncio, json, os, signal, sys
from pathlib import Path

logs = Path(os.environ["STUB_DIR"])
args = sys.argv[1:]
with open(logs / "calls.jsonl", "a") as f:
    f.write(json.dumps({"tool": "aws", "args": args}) + "\n")

def opt(name):
    return args[args.index(name) + 1]

if args[:2] == ["ec2", "describe-instances"]:
    print("HEAD_INSTANCE")
elif args[:2] == ["secretsmanager", "get-secret-value"]:
    assert opt("--secret-id") == "SECRET_ARN", args
    print(os.environ["STUB_RAY_TOKEN"])
elif args[:2] == ["ssm", "start-session"]:
    assert opt("--target") == "HEAD_INSTANCE", args
    assert opt("--document-name") == "AWS-StartPortForwardingSession", args
    local = int(json.loads(opt("--parameters"))["localPortNumber"][0])
    target = int(os.environ["STUB_FORWARD_TO"])

    async def pipe(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", local)
        (logs / "ssm.pid").write_text(str(os.getpid()))
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with server:
            await stop.wait()
        (logs / "ssm.closed").write_text("closed")

    asyncio.run(main())
else:
    sys.exit(f"stub aws: unexpected call {args}")
"""

PULUMI = r"""
import json, os, sys
from pathlib import Path

logs = Path(os.environ["STUB_DIR"])
with open(logs / "calls.jsonl", "a") as f:
    f.write(json.dumps({"tool": "pulumi", "args": sys.argv[1:], "cwd": os.getcwd()}) + "\n")
assert sys.argv[1:] == ["stack", "output", "--json"], sys.argv
forward = (
    "aws ssm start-session --region eu-west-1 --target \"$(aws ec2 describe-instances "
    "--region eu-west-1 --filters Name=tag:aws:autoscaling:groupName,Values=ASG "
    "Name=instance-state-name,Values=running --query 'Reservations[0].Instances[0]"
    ".InstanceId' --output text)\" --document-name AWS-StartPortForwardingSession "
    "--parameters '{\"portNumber\":[\"8265\"],\"localPortNumber\":[\"8265\"]}'"
)
print(json.dumps({
    "jobsApiPortForward": forward,
    "jobsApiLocalAddress": "http://127.0.0.1:8265",
    "rayAuthTokenSecretArn": "SECRET_ARN",
}))
"""


def install(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in (("aws", AWS), ("pulumi", PULUMI)):
        text = body.replace("HEAD_INSTANCE", HEAD_INSTANCE).replace("SECRET_ARN", SECRET_ARN)
        text = text.replace("ASG", ASG)
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{text}")
        path.chmod(0o755)


def calls(stub_dir: Path) -> list[dict]:
    path = stub_dir / "calls.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
