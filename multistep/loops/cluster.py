"""Worker processes on this machine, for ``MultiWorkerMirroredStrategy`` on 127.0.0.1.

Used by the tests, ``examples/two_workers.py`` and the distributed bench rows; it
imports no TensorFlow. Each worker is a Python process started with its own
``TF_CONFIG`` (every address ``127.0.0.1:port``); it creates the strategy, a
``tf.distribute.Server`` with the strategy's ``update_config_proto`` and a session on
that server's target. The ports are found by binding port 0 on 127.0.0.1 (the kernel
picks free ones) and handed to the workers; if one was taken again before a worker's
server could bind it, the workers are stopped and started again on new ports.

Every process is bounded in time: ``Workers.communicate`` stops them all (SIGKILL)
once its deadline has passed, and leaving the ``with`` block stops any still running.
"""

import json
import os
import signal
import socket
import subprocess
import tempfile
import time

__all__ = ["PORT_TAKEN", "PortTakenError", "WorkerFailedError", "Workers", "free_ports",
           "run_workers", "tf_config"]

HOST = "127.0.0.1"
# What a worker's stderr says when its server could not bind its port.
PORT_TAKEN = ("Address already in use", "Could not start gRPC server", "Failed to add port")


def free_ports(n):
    """``n`` distinct ports that were free on 127.0.0.1 a moment ago."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:  # all bound at once: the kernel hands out n distinct ports
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(ports, index, job="worker"):
    """``TF_CONFIG`` for task ``index`` of a one-job cluster on 127.0.0.1."""
    return json.dumps({"cluster": {job: [f"{HOST}:{p}" for p in ports]},
                       "task": {"type": job, "index": index}})


class PortTakenError(RuntimeError):
    """A worker's server could not bind the port it was given: another process took it."""


class WorkerFailedError(RuntimeError):
    """A worker exited with an error while its peers were still running."""


class Workers:
    """``n`` worker processes running ``argv`` (e.g. ``[sys.executable, "worker.py"]``),
    worker i with ``TF_CONFIG`` for task i and ``MULTISTEP_WORKER=i`` in its
    environment; their stdout and stderr go to files read back as text.

    Use as a context manager: on leaving, any worker still running is killed.
    """

    def __init__(self, argv, n=2, *, env=None, cwd=None):
        self.argv, self.n, self.cwd = list(argv), n, cwd
        self.env = dict(os.environ if env is None else env)
        self.ports = free_ports(n)
        self._dir = tempfile.TemporaryDirectory(prefix="multistep-workers-")
        self.procs, self._files = [], []
        for i in range(n):
            env_i = dict(self.env, TF_CONFIG=tf_config(self.ports, i), MULTISTEP_WORKER=str(i))
            # Open as long as the process runs; stop() closes them.
            out = open(os.path.join(self._dir.name, f"{i}.out"), "w+")  # noqa: SIM115
            err = open(os.path.join(self._dir.name, f"{i}.err"), "w+")  # noqa: SIM115
            self._files.append((out, err))
            self.procs.append(subprocess.Popen(self.argv, env=env_i, cwd=cwd, stdout=out, stderr=err,
                                               stdin=subprocess.DEVNULL))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def stdout(self, i):
        with open(self._files[i][0].name) as f:
            return f.read()

    def stderr(self, i):
        with open(self._files[i][1].name) as f:
            return f.read()

    def port_taken(self):
        """True if a worker ended because its port was taken (start again on new ports)."""
        return any(p.poll() is not None and p.returncode != 0
                   and any(s in self.stderr(i) for s in PORT_TAKEN)
                   for i, p in enumerate(self.procs))

    def wait_for(self, i, text, timeout):
        """Waits until worker ``i`` has printed ``text``; raises if it ends first or
        ``timeout`` seconds pass (the workers are left running: leave the block)."""
        deadline = time.monotonic() + timeout
        while text not in self.stdout(i):
            if self.procs[i].poll() is not None:
                raise RuntimeError(f"worker {i} ended (exit {self.procs[i].returncode}) before printing "
                                   f"{text!r}:\n{self.stderr(i)[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {i} did not print {text!r} within {timeout} s:\n"
                                   f"{self.stderr(i)[-3000:]}")
            time.sleep(0.05)

    def signal(self, i, signum=signal.SIGKILL):
        self.procs[i].send_signal(signum)

    def communicate(self, timeout, which=None, *, grace=10.0):
        """Waits up to ``timeout`` seconds in all for the workers ``which`` (default: all)
        to end; returns ``[(returncode, stdout, stderr)]`` for them. Past the deadline
        every worker is killed and ``TimeoutError`` says which were still running; if a
        worker's port was taken, they are all killed at once and ``PortTakenError``
        raised (its peers would otherwise wait for it until the deadline). If one of
        ``which`` fails (a non-zero exit) while others of them still run, they get
        ``grace`` seconds to end too, then are killed and ``WorkerFailedError`` shows
        the failed worker's stderr (its peers may wait for it with no timeout)."""
        which = list(range(self.n) if which is None else which)
        deadline = time.monotonic() + timeout
        failed_at = None
        while any(self.procs[i].poll() is None for i in which):
            if self.port_taken():
                self.stop()
                raise PortTakenError(f"a worker's port was taken (ports {self.ports})")
            failed = [i for i in which if self.procs[i].poll() not in (None, 0)]
            if failed and failed_at is None:
                failed_at = time.monotonic()
            if failed and time.monotonic() > failed_at + grace:
                self.stop()
                i = failed[0]
                raise WorkerFailedError(
                    f"worker {i} failed (exit {self.procs[i].returncode}) while its peers ran on "
                    f"(killed after {grace} s); its stderr:\n{self.stderr(i)[-3000:]}")
            if time.monotonic() > deadline:
                late = [i for i in which if self.procs[i].poll() is None] or which
                self.stop()
                raise TimeoutError(f"workers {late} still running after {timeout} s (killed); "
                                   f"stderr of worker {late[0]}:\n{self.stderr(late[0])[-3000:]}")
            time.sleep(0.05)
        return [(self.procs[i].returncode, self.stdout(i), self.stderr(i)) for i in which]

    def stop(self):
        """Kills every worker still running and waits for it; closes the output files."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a process that survives SIGKILL: nothing more to do
                pass
        for out, err in self._files:
            out.close()
            err.close()

    def __del__(self):
        if getattr(self, "procs", None):
            for p in self.procs:
                if p.poll() is None:
                    p.kill()


def run_workers(argv, n=2, *, timeout=120, env=None, cwd=None, attempts=3):
    """Starts ``n`` workers, waits for them all (at most ``timeout`` seconds an
    attempt), stops them, and returns ``[(returncode, stdout, stderr)]``. Starts again
    on new ports, at most ``attempts`` times in all, if a worker's port had been taken."""
    for attempt in range(attempts):
        with Workers(argv, n, env=env, cwd=cwd) as workers:
            try:
                return workers.communicate(timeout)
            except PortTakenError:
                if attempt == attempts - 1:
                    raise
    raise AssertionError("unreachable")
