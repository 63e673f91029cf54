from kubesgl.router.radix_tree import PrefixTree


def test_match_length_follows_inserted_prefixes():
    tree = PrefixTree(max_chars=1000)
    tree.insert("system: be brief\nuser: hi")
    tree.insert("system: be brief\nuser: bye")
    assert tree.match_length("system: be brief\nuser: hello") == len("system: be brief\nuser: h")
    assert tree.match_length("system: be brief\nuser: bye now") == len(
        "system: be brief\nuser: bye"
    )
    assert tree.match_length("other") == 0
    assert tree.match_length("") == 0
    # Shared text is stored once: the two inserts share 23 characters.
    assert tree.size == len("system: be brief\nuser: hi") + len("bye")


def test_match_inside_an_edge():
    tree = PrefixTree(max_chars=100)
    tree.insert("abcdefgh")
    assert tree.match_length("abcdXYZ") == 4
    assert tree.match_length("abcdefghij") == 8


def test_eviction_keeps_the_tree_bounded_and_drops_least_recently_used_first():
    tree = PrefixTree(max_chars=40)
    tree.insert("old-" + "a" * 10)
    tree.insert("new-" + "b" * 10)
    tree.insert("old-" + "a" * 10)  # touched again: now the most recent
    tree.insert("fresh-" + "c" * 10)  # 44 chars > 40: evicts down to 36
    assert tree.size == 30
    assert tree.match_length("old-" + "a" * 10) == 14
    assert tree.match_length("fresh-" + "c" * 10) == 16
    assert tree.match_length("new-" + "b" * 10) == 0


def test_eviction_removes_emptied_parents():
    tree = PrefixTree(max_chars=12)
    tree.insert("prefix-a")
    tree.insert("prefix-b")  # splits: "prefix-" + "a" and "b"
    tree.insert("zzzzzzzzzz")  # forces the whole "prefix-" branch out
    assert tree.match_length("prefix-a") == 0
    assert tree.size == 10
