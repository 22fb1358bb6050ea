"""In-process algorithm benchmark (``cryptd bench``, ``python -m loadtest.algorithms``): the
measurement in :mod:`.rates`, its text table in :mod:`.table`, the command in ``__main__``."""
