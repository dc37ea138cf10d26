"""The pages layer: the directory of pages, the block manager (allocation, eviction, restore), the prefix index, block tables, and how they are persisted. It never imports the store."""
