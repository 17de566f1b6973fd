"""Rewards for the online RL objectives: functions users write in Python, loaded by path
(`path/to/file.py:name`), and the built-ins (a math answer match, a format regex, a
length target). Each takes `(prompts, completions, **columns)`, TRL's signature, and
returns one float per completion; anything else stops the run naming the row."""
