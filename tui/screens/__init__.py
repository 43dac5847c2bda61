"""The dashboard's screens: the main one, and the modal dialogs over it."""
