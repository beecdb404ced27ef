"""Test doubles, named as such: misbehaving runners, a full disk, a read-only folder. They stand in for faults so
the harness's handling of each can be tested; none of them ever feeds a reported verdict of a real comparison."""
