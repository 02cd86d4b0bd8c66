"""Upstream-contribution patch generation (installed as ``graft.tools.patches``).

An adapter describes how its kernels would live natively inside a framework's source
tree with :class:`~graft.tools.patches.template.PatchTemplate` objects (returned from the
``graft_patch_templates`` hook). ``graft patches generate`` turns them into
``git format-patch`` files against a checkout; ``graft patches check`` verifies they
apply cleanly and that the patched tree still imports.
"""
from graft.tools.patches.template import CreateFile, InsertAfter, PatchTemplate, ReplaceRegex, ReplaceText

__all__ = ["PatchTemplate", "CreateFile", "InsertAfter", "ReplaceRegex", "ReplaceText"]
