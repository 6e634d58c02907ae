"""The hybrid memory core: pure Python, never imports torch.

Glossary:
- *layer cache*: what one layer keeps (attention KV per token, or a recurrent state per sequence).
- *group*: layers with equal specs; they share pages.
- *block*: a span of ``block_tokens`` tokens of a sequence (the unit of prefix hashing).
- *page*: a slot in the arena holding one block of every layer of an attention group,
  or one full state (a live state or a snapshot) of every layer of a recurrent group.
- *chunk*: the unit of memory that moves between groups; a group carves it into pages.
- *snapshot*: a copy of a recurrent state taken at a block-aligned position, cached
  under the hash of the block that ends there.
"""
