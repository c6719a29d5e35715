"""The prefix index: chained page hashes, the radix trie, one trie per namespace behind one leaf lock."""
