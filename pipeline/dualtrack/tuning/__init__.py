"""The tuners, beside the compiler: they measure on a GPU what the build then reads.

- :mod:`.track_a` (`dualtrack tune`): the conv kernels' tiles per problem and GPU, searched over
  :mod:`.space`, every candidate verified before it is timed;
- :mod:`.track_b` (`dualtrack tune --track-b`): IREE flag sets per Track B segment.

Both write the tuning file (:mod:`dualtrack.compiler.tuned`), which `dualtrack build` reads.
"""

from dualtrack.tuning.tiles import TuneOptions, TuneResult, tune_track_a

__all__ = ["TuneOptions", "TuneResult", "tune_track_a"]
