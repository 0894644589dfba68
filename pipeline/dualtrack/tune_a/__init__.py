"""Track A tuning: the search space of the conv3x3 kernel's tiles (:mod:`.space`), the problems a
plan poses (:mod:`.problems`), and the search on a GPU (:mod:`.search`, `dualtrack tune`). The
tuning file itself is :mod:`dualtrack.tuning`."""

from dualtrack.tune_a.search import TuneOptions, TuneResult, tune_track_a

__all__ = ["TuneOptions", "TuneResult", "tune_track_a"]
