from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor
LIVE_FIELD_NUMBER: _ClassVar[int]
live: _descriptor.FieldDescriptor
DEFAULT_VALUE_FIELD_NUMBER: _ClassVar[int]
default_value: _descriptor.FieldDescriptor
MINIMUM_FIELD_NUMBER: _ClassVar[int]
minimum: _descriptor.FieldDescriptor
MAXIMUM_FIELD_NUMBER: _ClassVar[int]
maximum: _descriptor.FieldDescriptor
