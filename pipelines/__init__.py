"""Pipeline builders and compiled pipelines (installed as fedpipe.pipelines)."""
