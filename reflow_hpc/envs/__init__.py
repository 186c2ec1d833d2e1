"""Tasks and multi-turn environments (DESIGN §6): prompts, rewards, tool calls, the tiny tokenizer.

Importing this package registers the classes of the built-in tasks (``arithmetic``, ``math_boxed``,
``calculator_tool``) by name, for ``make_task``; their config rules are ``config``'s. ``math_reward``
is the one scorer of math answers (``envs/math_score.py``). It imports neither torch nor transformers.
"""

from .task import (Episode, Observation, Prompt, Task, make_task, prompt_token_ids, register_task,
                   task_names)
from .math_score import math_reward
from . import (arithmetic, calculator_tool, code_apps, code_humaneval, code_synth,  # noqa: F401  (registration)
               math_boxed, retool)

__all__ = ["Episode", "Observation", "Prompt", "Task", "make_task", "math_reward", "prompt_token_ids",
           "register_task", "task_names"]
