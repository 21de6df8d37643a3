"""Task data and task evaluation: function calling (BFCL) and its tool-call format."""
