"""What every layer of distlearn shares, below them all: ``distlearn.common``.

The layers, lowest first: this one, then ``distlearn.dataset`` and ``distlearn.ipc``
(side by side: neither imports the other), then ``distlearn`` itself (SGD/EA over any
communicator). ``dataset`` and ``ipc`` import nothing of distlearn but this package;
this package imports nothing of distlearn but itself (``tests/test_layers.py`` checks
both). Each helper here was written two or three times before, and the copies
disagreed; one copy each now:

- :mod:`.envvars`: typed readers of environment variables, one rule for all of them;
- :mod:`.launchers`: which launcher started this process (torchrun, Slurm, or
  RANK/WORLD_SIZE set by hand), its rank and world size;
- :mod:`.keywords`: a misspelt keyword is a ``TypeError`` naming the closest one;
- :mod:`.net`: whether a host names this machine's loopback interface only;
- :mod:`.procs`: a child process that dies with its parent;
- :mod:`.errors`: :class:`~.errors.RemoteTraceback`, another process's traceback as text.

Importing this package imports none of its modules; import them by name.
"""

__all__: list[str] = []
