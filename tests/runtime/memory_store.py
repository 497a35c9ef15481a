"""A c10d store in memory for unit tests: the calls the failure channel, the construction agreement and the votes
make (every key a test waits for is already there: ``wait`` asserts it instead of blocking)."""


class MemoryStore:
    def __init__(self):
        self.data = {}

    def add(self, key, n):
        self.data[key] = self.data.get(key, 0) + n
        return self.data[key]

    def set(self, key, value):
        self.data[key] = value

    def compare_set(self, key, expected, value):  # as c10d's: the value now under key (set if absent)
        if key not in self.data or self.data[key] == expected:
            self.data[key] = value
        current = self.data[key]
        return current.encode() if isinstance(current, str) else current

    def wait(self, keys, timeout):
        assert all(k in self.data for k in keys), [k for k in keys if k not in self.data]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key].encode()
