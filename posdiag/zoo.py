"""`posdiag.zoo` stays importable for users: it is `posdiag.testing.zoo` (the tiny-model zoo)."""

import sys

from posdiag.testing import zoo

sys.modules[__name__] = zoo
