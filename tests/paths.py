"""Where the suite's files are: the repository's root and the tests' folder, for the test files
in tests/<layer>/ and the support modules beside this one, so that no test counts folders up
from its own ``__file__``."""
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
