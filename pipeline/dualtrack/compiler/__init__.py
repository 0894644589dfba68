"""The compiler: config -> front end -> partition -> lowering -> the two tracks' builds -> bundle.

It writes what :mod:`dualtrack.runtime` reads (:mod:`dualtrack.contract`) and is never imported by
it. :func:`dualtrack.compiler.build.build` is the driver.
"""
