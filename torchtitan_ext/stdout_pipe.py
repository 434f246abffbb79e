"""Output piped into a reader that stops early (``moe-flavors | head -1``) ends a command quietly."""

import os
import signal
import sys
from collections.abc import Callable

READER_GONE_EXIT_CODE = 128 + signal.SIGPIPE
"""What a shell reports for a command whose output pipe closed under it (as ``seq 99999 | head -1``)."""


def until_the_reader_stops(main: Callable[[], int]) -> int:
    """``main()``'s exit code, or ``READER_GONE_EXIT_CODE`` without a traceback when the reader of
    stdout closed it before everything was written."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The interpreter flushes stdout once more at exit: let that write go nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return READER_GONE_EXIT_CODE
