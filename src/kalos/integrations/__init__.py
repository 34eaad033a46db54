"""Adapters that make Kalos a store of the LLM frameworks: :mod:`kalos.integrations.langchain`
(extra ``kalos[langchain]``; mem0 uses it through its ``"langchain"`` vector-store provider)
and :mod:`kalos.integrations.llamaindex` (extra ``kalos[llamaindex]``). Each imports its
framework, so import the one you use; this package imports nothing."""
