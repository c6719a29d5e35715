"""Tests of `api.keys`: frontends, their keys and end users, who a request acts for, the audit trail."""
