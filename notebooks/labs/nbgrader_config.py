"""nbgrader 0.9.6 configuration for kvlab's labs: copy it into a course directory's root.

The course directory holds each lab's source as source/<lab>/<lab>.ipynb, copied from
notebooks/labs/source/ (see notebooks/labs/INSTRUCTOR.md); tests/test_labs_nbgrader.py runs
the whole workflow with exactly this file.
"""

c = get_config()  # noqa: F821 (nbgrader's config loader defines it)
c.CourseDirectory.course_id = "kvlab"
# nbgrader copies every other file of a source folder into the release: the jupytext pair
# source/<lab>/<lab>.py holds the solutions, so it (and any .py) stays out.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", "*.py"]

# The student version gets kvlab's own stub (the TODO comments above it stay), so that the
# release is exactly notebooks/labs/<lab>.ipynb, what `python -m kvlab.labs.student` makes.
c.ClearSolutions.code_stub = {"python": "raise NotImplementedError"}

c.Execute.timeout = 120  # seconds per cell (nbgrader's default, 30, is tight on a busy laptop)
c.Execute.startup_timeout = 120  # kernel start-up: importing torch on a busy 2-core machine
c.Execute.shutdown_kernel = "immediate"  # "graceful" waits 1-3 s more per notebook
# xmode=Minimal: a failing check cell's output is "LabFailure: <kvlab's report>", without the
# source lines around the failing line (which would show the hidden tests).
c.Execute.extra_arguments = ["--HistoryManager.enabled=False", "--InteractiveShell.xmode=Minimal"]

# A submission whose check cell was deleted gets it back (and runs it) instead of a silent 0.
c.OverwriteCells.add_missing_cells = True

# Feedback without the hidden tests' source (nbgrader 0.9.6's default feedback shows it).
c.GenerateFeedback.preprocessors = [
    "nbgrader.preprocessors.GetGrades",
    "nbgrader.preprocessors.ClearHiddenTests",
    "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor",
]
