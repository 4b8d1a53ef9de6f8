"""In-tree FlashOverlap backends (vendor code lives here and in csrc/, never in the core)."""
