"""Screens over the main one: help, explain and diff pages, a question with a few answers, a new profile, a
launch."""
