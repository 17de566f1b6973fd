"""Rewards users write and the built-ins: the values, the columns passed through, and
every bad reward (raises, wrong count, not a number, too slow, not loadable) stopping the
run in one line that names the function and the row, never a silent 0."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trainer.config.rl import RewardSpec
from trainer.rewards.builtin import final_answer, format_regex, length_target, math_answer
from trainer.rewards.runner import RewardError, Rewards

PROMPTS = ["What is 6 x 7?", "What is 2 + 2?", "Name a colour."]
COMPLETIONS = ["6 x 7 = 42. #### 42", "The answer is \\boxed{5}", "Blue, 3 letters? no, 4"]
COLUMNS = {"answer": ["... #### 42", "2 + 2 = 4\n#### 4", "#### 1,000"]}
IDS = [[5, 6, 7], [5, 6], [5, 6, 7, 8, 9]]

USER = textwrap.dedent(
    """
    import threading

    def exact(prompts, completions, answer, **kw):
        return [float(a.endswith(c[-2:])) for c, a in zip(completions, answer)]

    def raises_on_boxed(prompts, completions, **kw):
        return [1 / (0 if "boxed" in c else 1) for c in completions]

    def short(prompts, completions, **kw):
        return [1.0] * (len(completions) - 1)

    def none_for_colour(prompts, completions, **kw):
        return [None if "colour" in p else 1.0 for p in prompts]

    def text(prompts, completions, **kw):
        return ["1.0" for _ in completions]

    def nan(prompts, completions, **kw):
        return [float("nan") for _ in completions]

    def hangs_on_two(prompts, completions, **kw):
        if any("2 + 2" in p for p in prompts):
            threading.Event().wait()
        return [0.0 for _ in completions]

    def batch_only(prompts, completions, **kw):
        assert len(completions) == 1, "scores rows one at a time"
        return [1.0]

    def columns_seen(prompts, completions, completion_ids, **kw):
        return [float(len(ids) + len(kw)) for ids in completion_ids]
    """
)


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    (tmp_path / "my_rewards.py").write_text(USER)
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    return tmp_path


def _rewards(base: Path, *functions: str, timeout: float = 30.0) -> Rewards:
    return Rewards([RewardSpec(function=f) for f in functions], timeout, base)


def _score(r: Rewards) -> list[list[float]]:
    return r.score(PROMPTS, COMPLETIONS, COLUMNS, IDS)


def test_builtins() -> None:
    assert math_answer(PROMPTS, COMPLETIONS, **COLUMNS) == [1.0, 0.0, 0.0]
    assert math_answer([""], ["so $1,000."], answer=["#### 1000"]) == [1.0]
    assert final_answer("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert final_answer("no answer") is None
    chat = [[{"role": "assistant", "content": "#### 42"}]]
    assert math_answer(["q"], chat, answer=["#### 42"]) == [1.0]
    assert format_regex(PROMPTS, COMPLETIONS, pattern=r"#### \d+$") == [1.0, 0.0, 0.0]
    assert length_target(PROMPTS, COMPLETIONS, target=4, completion_ids=IDS) == [0.75, 0.5, 0.75]
    assert length_target(["p"], ["abcd"], target=2, unit="chars") == [0.0]


def test_user_function_and_builtins_together(user_file: Path) -> None:
    specs = [
        RewardSpec(function="my_rewards.py:exact", weight=2.0),
        RewardSpec(function="math_answer"),
        RewardSpec(function="length_target", options={"target": 3}),
    ]
    r = Rewards(specs, 30.0, user_file)
    assert r.names == ["exact", "math_answer", "length_target"] and r.weights == [2.0, 1.0, 1.0]
    assert _score(r) == [
        [1.0, 1.0, 1.0],
        [0.0, 0.0, pytest.approx(2 / 3)],
        [0.0, 0.0, pytest.approx(1 / 3)],
    ]


def test_columns_and_completion_ids_pass_through(user_file: Path) -> None:
    r = _rewards(user_file, "my_rewards.py:columns_seen")
    assert _score(r) == [[4.0], [3.0], [6.0]]  # its ids' length + the one other column


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (
            "raises_on_boxed",
            r"train\.rl\.rewards\[0\] \(my_rewards\.py:raises_on_boxed\) raised "
            r"ZeroDivisionError: division by zero on prompt 'What is 2 \+ 2\?' and completion "
            r"'The answer is \\\\boxed\{5\}'",
        ),
        (
            "none_for_colour",
            r"returned None \(not a finite number\) on prompt 'Name a colour\.'",
        ),
        ("text", r"returned '1\.0' \(not a finite number\) on prompt 'What is 6"),
        ("nan", r"returned nan \(not a finite number\)"),
        ("batch_only", r"raised AssertionError: scores rows one at a time on a batch of 3"),
    ],
)
def test_bad_reward_stops_naming_the_row(user_file: Path, function: str, message: str) -> None:
    r = _rewards(user_file, f"my_rewards.py:{function}")
    with pytest.raises(RewardError, match=message) as e:
        _score(r)
    assert "\n" not in str(e.value)


def test_wrong_count_names_the_first_row_it_fails_on(user_file: Path) -> None:
    # one row alone gets 0 values for 1 completion: the first row is named
    with pytest.raises(RewardError, match=r"0 values for 1 completions on prompt 'What is 6"):
        _score(_rewards(user_file, "my_rewards.py:short"))


def test_a_reward_past_its_timeout_stops_the_run(user_file: Path) -> None:
    r = _rewards(user_file, "my_rewards.py:hangs_on_two", timeout=0.3)
    with pytest.raises(
        RewardError,
        match=r"ran past train\.rl\.reward_timeout_s = 0\.3 s on prompt 'What is 2 \+ 2\?'",
    ):
        _score(r)


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("missing.py:f", r"no file .*missing\.py; give the path relative to"),
        ("my_rewards.py:absent", r"has no function 'absent'"),
        ("broken.py:f", r"importing .*broken\.py raised ModuleNotFoundError"),
    ],
)
def test_unloadable_reward(user_file: Path, function: str, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        _rewards(user_file, function)


@pytest.mark.parametrize(
    ("options", "function", "message"),
    [
        ({}, "format_regex", "format_regex needs options.pattern"),
        ({"pattern": "("}, "format_regex", "options.pattern is not a regex"),
        ({"target": 0}, "length_target", r"options.target, an integer >= 1"),
        ({"colum": "a"}, "math_answer", r"options \['colum'\] are not options of math_answer"),
    ],
)
def test_builtin_options_checked_in_the_config(options, function, message) -> None:
    with pytest.raises(ValueError, match=message):
        RewardSpec(function=function, options=options)
