"""Elastic membership (``--elastic MIN:MAX``): deaths noticed, survivors rebuilt, joiners admitted."""
