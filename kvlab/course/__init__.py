"""The course's own tools: the library's lines shown where the learner reads, and
exercises that check themselves.

    from kvlab.course import ask, show_source

    show_source(BlockAllocator.allocate)        # the lines that implement it, from kvlab's source
    ask("01.kv-bytes", my_answer, model=model)  # right, not yet (with a hint), or not answered

Each notebook's exercises are one file, `kvlab/course/exercises/nNN_*.py`, registered by
`@exercise`; `python -m kvlab.course.answers` renders the answer key
(notebooks/ANSWERS.md, kept out of what learners read in the notebooks).
"""

from kvlab.course import exercises  # noqa: F401  (registers every notebook's exercises)
from kvlab.course.exercise import EXERCISES, Exercise, Verdict, ask, exercise
from kvlab.course.source import show_source

__all__ = ["EXERCISES", "Exercise", "Verdict", "ask", "exercise", "show_source"]
