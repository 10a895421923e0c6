"""Frontend: a module call becomes a Relax function.

``signature`` binds a call the way Python binds it, ``export`` traces it with ``torch.export``,
``importer`` converts the exported program to Relax with the bridge's converters (``converters``, by
family), after ``checks`` refused what cannot be converted.
"""
