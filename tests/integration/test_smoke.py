def test_smoke(node):
    from client import KVClient

    with KVClient(node.unix) as kv:
        assert kv.put(b"k" * 16, b"hello")
        assert kv.get(b"k" * 16) == b"hello"
    assert node.stop() == 0
