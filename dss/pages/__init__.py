"""KV pages: the page table, the tier backends, moving bytes between them, eviction, page files and codecs.

Nothing here knows the index; a page that leaves every tier is returned to the caller."""
