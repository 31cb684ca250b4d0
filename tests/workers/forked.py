"""What torchrun starts for a rank in the tests: ``python forked.py WORKER ARGS...``. The rank itself runs as a fork
of the test process's preloaded server (`tests.launch.fork_service`), ``python WORKER ARGS...`` as `runpy` runs it,
with this process's environment (torchrun's variables) and directory. Signals sent to this process go to the rank;
its output and exit status come back here when it ends. Standard-library imports only: torchrun's rank starts in
milliseconds instead of ~10 s of imports."""

import os
import signal
import sys
from multiprocessing.connection import Client

RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def main() -> None:
    script, *argv = sys.argv[1:]
    if not os.path.isabs(script):
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
    conn = Client(os.environ["HF_ACCUM_TEST_FORK_SERVICE"],
                  authkey=bytes.fromhex(os.environ["HF_ACCUM_TEST_FORK_KEY"]))
    conn.send((script, argv, dict(os.environ), os.getcwd()))
    pid = conn.recv()
    def relay(number, _frame):
        try:
            os.kill(pid, number)
        except ProcessLookupError:  # the rank has ended (torchrun ends the others when one stops): its status follows
            pass

    for sig in RELAYED:  # torchrun's forwarded SIGTERM, a test's SIGUSR1 for the stacks: to the rank
        signal.signal(sig, relay)
    code, out, err = conn.recv()
    sys.stdout.write(out)
    sys.stderr.write(err)
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:  # ended by a signal: end the same way, as torchrun would see the rank end
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
