"""The server's response models (api/server/objects.py) and the OpenAPI schema served from
them agree with the official `openai` SDK's types for every field we return: the names,
which are always there, and the values a literal field may take."""

from __future__ import annotations

import typing

import pytest
from openai.types import Batch, FileObject
from openai.types.shared import ErrorObject

from specq.api.server import objects
from specq.api.server.app import create_app
from specq.configs.settings import Settings

PAIRS = [(objects.BatchObject, Batch), (objects.FileObject, FileObject),
         (objects.ErrorDetail, ErrorObject),
         (objects.RequestCounts, typing.get_args(Batch.model_fields["request_counts"]
                                                 .annotation)[0])]
OURS_ONLY = {"specq"}  # specq's figures: an extra field every SDK keeps (model_extra)


def _literals(annotation) -> set[str] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    for arg in typing.get_args(annotation):
        found = _literals(arg)
        if found is not None:
            return found
    return None


@pytest.mark.parametrize(("ours", "sdk"), PAIRS, ids=lambda m: m.__name__)
def test_our_models_match_the_sdks_types(ours, sdk):
    extra = set(ours.model_fields) - set(sdk.model_fields) - OURS_ONLY
    assert not extra, f"{ours.__name__} returns fields the SDK does not know: {extra}"
    for name, field in sdk.model_fields.items():
        if field.is_required():
            assert name in ours.model_fields and ours.model_fields[name].is_required(), name
        if name in ours.model_fields:
            mine, theirs = (_literals(ours.model_fields[name].annotation),
                            _literals(field.annotation))
            if mine is not None:
                assert theirs is not None and mine <= theirs, (name, mine - (theirs or set()))


def test_the_served_openapi_schema_has_the_same_shapes(tmp_path):
    app = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
                              data_dir=tmp_path))
    schema = app.openapi()
    shapes = schema["components"]["schemas"]
    for ours, sdk in PAIRS:
        served = shapes[ours.__name__]
        assert set(served["properties"]) - OURS_ONLY <= set(sdk.model_fields)
        assert {n for n, f in sdk.model_fields.items() if f.is_required()} <= set(
            served.get("required", ()))
    ok = {"get /v1/batches/{batch_id}": "BatchObject", "post /v1/batches": "BatchObject",
          "get /v1/batches": "BatchList", "get /v1/files/{file_id}": "FileObject",
          "post /v1/files": "FileObject", "get /v1/files": "FileList"}
    for route, model in ok.items():
        path, method = route.split(" ")[1], route.split(" ")[0]
        answers = schema["paths"][path][method]["responses"]
        assert answers["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/" + model)
        assert answers["404"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorResponse")


def test_a_completion_window_is_ascii_digits_and_a_unit():
    from specq.api.server.batches import window_seconds
    from specq.api.server.errors import ApiError

    assert window_seconds("24h", 86400) == 86400 and window_seconds("90s", 86400) == 90
    for bad in ("\uff12\uff14h", "24", "h", "0h", "2d", " 24h", "24H", "1e3s"):
        with pytest.raises(ApiError, match="completion_window"):
            window_seconds(bad, 86400)
