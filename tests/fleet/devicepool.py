"""Many SimDevices on one broker, in a process of their own: paho waits on select(), which fails on a file
descriptor past 1023, and each device holds three (its socket and a wake-up pair), so a few hundred devices
in the test process itself stop connecting once earlier tests have used some.

    python tests/fleet/devicepool.py PORT RECORDS ID [ID...]

Connects the devices (each answering commands and keeping its job notices), sends RECORDS records from each,
and once the broker has acknowledged them all prints one JSON line: {"produced": [[device, boot, seq], ...]}.
Then prints {"notice": device, "payload": ...} for every job notice, until its stdin closes.
"""
from __future__ import annotations

import json
import sys
import threading
import time

from simdevice import SimDevice

BATCH_RECORDS = 4


def main(port: int, records: int, device_ids: list[str]) -> None:
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
    for _ in range(0, records, BATCH_RECORDS):
        for device in devices:
            device.emit(BATCH_RECORDS)
    deadline = time.monotonic() + 60
    while any(d.unacked for d in devices) and time.monotonic() < deadline:
        time.sleep(0.05)
    say({"produced": [[d.device_id, r.boot_id, r.seq] for d in devices for r in d.produced],
         "unacked": sum(d.unacked for d in devices)})
    sys.stdin.read()  # until the test is done with us
    for device in devices:
        device.client.disconnect()
        device.client.loop_stop()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
