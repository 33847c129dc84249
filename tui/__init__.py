"""ranktop's face: the Textual app and the `ranktop` command line.

Importing this package must stay cheap and free of Textual: `ranktop --headless` goes through it.
"""
