"""User-facing errors: the CLI prints them without a traceback and exits non-zero."""


class SaeflowError(Exception):
    """Something the user can fix (bad input, bad config, damaged data). Message says what and where."""


class ShardDirError(SaeflowError):
    """A shard directory is incomplete, corrupt, or does not match its hash.

    `problems` lists every problem found (each names the file), so a scratch purge is reported at once.
    """

    def __init__(self, dpath, problems, hint: str = ""):
        self.dpath = dpath
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid shard directory {dpath}:\n{lines}" + (f"\n{hint}" if hint else ""))
