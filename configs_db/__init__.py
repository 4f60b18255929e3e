"""The config database (SQLAlchemy) and the JSON bundles shipped per GPU."""
