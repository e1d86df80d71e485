"""Request ids as users paste them: the id itself or the id of the completion object they hold."""

from pdserve.gateway.responses import ChatFormatter, CompletionFormatter
from pdserve.ids import OPENAI_ID_PREFIXES, new_id, request_id_of


def test_the_response_bodys_id_names_its_request():
    rid = new_id()
    for formatter in (ChatFormatter, CompletionFormatter):
        assert formatter.id_prefix in OPENAI_ID_PREFIXES
        assert request_id_of(f"{formatter.id_prefix}{rid}") == rid
    assert request_id_of(rid) == rid
