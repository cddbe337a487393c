"""Many SimDevices on one broker, in a process of their own: paho waits on select(), which fails on a file
descriptor past 1023, and each device holds three (its socket and a wake-up pair), so a few hundred devices
in the test process itself stop connecting once earlier tests have used some.

    python tests/fleet/devicepool.py [--rounds N --every S] PORT RECORDS ID [ID...]

Connects the devices (each answering commands and keeping its job notices), sends RECORDS records from each
(in N rounds S seconds apart, printing {"round": k} after each), and once the broker has acknowledged them all
prints one JSON line: {"produced": [[device, boot, seq], ...]}. Then prints {"notice": device, "payload": ...}
for every job notice, until its stdin closes. `DevicePool` runs it from a test.
"""
from __future__ import annotations

import json
import sys
import threading
import time

from simdevice import SimDevice

BATCH_RECORDS = 4


def main(port: int, records: int, device_ids: list[str], rounds: int = 1, every_s: float = 0.0) -> None:
    said = threading.Lock()

    def say(line: dict) -> None:
        with said:
            print(json.dumps(line), flush=True)

    devices = [SimDevice(port, d, seed=i, take_jobs=True) for i, d in enumerate(device_ids)]
    for device in devices:
        device.on_notice = lambda payload, d=device.device_id: say({"notice": d, "payload": payload.decode()})
        device.start()
    for device in devices:
        device.wait_connected(60)
    for k in range(rounds):
        for _ in range(0, records // rounds, BATCH_RECORDS):
            for device in devices:
                device.emit(min(BATCH_RECORDS, records // rounds))
        say({"round": k + 1})
        time.sleep(every_s)
    deadline = time.monotonic() + 60
    while any(d.unacked for d in devices) and time.monotonic() < deadline:
        time.sleep(0.05)
    say({"produced": [[d.device_id, r.boot_id, r.seq] for d in devices for r in d.produced],
         "unacked": sum(d.unacked for d in devices)})
    sys.stdin.read()  # until the test is done with us
    for device in devices:
        device.client.disconnect()
        device.client.loop_stop()


class DevicePool:
    """This script in a subprocess: the devices of one broker, their records and their notices."""

    def __init__(self, port: int, device_ids: list[str], records: int, rounds: int = 1, every_s: float = 0.0):
        import os
        import subprocess

        from fleet_support import REPO

        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, __file__, "--rounds", str(rounds), "--every", str(every_s),
                                      str(port), str(records), *device_ids], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.rounds_done = 0
        self.produced: set[tuple] | None = None  # once the broker has acknowledged every batch, or given up
        self.unacked = 0  # batches never acknowledged
        self.notices: dict[str, list[str]] = {}  # device -> job ids, as received
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        from agent.wire import JobDocument

        for line in self.proc.stdout:
            said = json.loads(line)
            if "round" in said:
                self.rounds_done = said["round"]
            elif "produced" in said:
                self.unacked = said["unacked"]
                self.produced = {tuple(k) for k in said["produced"]}
            else:
                job_id = JobDocument.model_validate_json(said["payload"]).job_id
                self.notices.setdefault(said["notice"], []).append(job_id)

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


if __name__ == "__main__":
    args = sys.argv[1:]
    pacing = {"--rounds": 1, "--every": 0.0}
    while args and args[0] in pacing:
        pacing[args[0]] = type(pacing[args[0]])(args[1])
        args = args[2:]
    main(int(args[0]), int(args[1]), args[2:], pacing["--rounds"], pacing["--every"])
