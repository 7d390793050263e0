package apiserver

import (
	"fmt"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/kernflux/opendsec/internal/errdefs"
)

// protoCodec is connect's binary protobuf codec, except that a request with
// invalid UTF-8 in a string field is rejected with an error naming the
// field ("path: is not valid UTF-8 ...") instead of protobuf's anonymous
// "string field contains invalid UTF-8".
type protoCodec struct{}

func (protoCodec) Name() string { return "proto" }

func (protoCodec) Marshal(m any) ([]byte, error) {
	msg, ok := m.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("marshal %T: not a proto message", m)
	}
	return proto.Marshal(msg)
}

func (protoCodec) Unmarshal(b []byte, m any) error {
	msg, ok := m.(proto.Message)
	if !ok {
		return fmt.Errorf("unmarshal into %T: not a proto message", m)
	}
	err := proto.Unmarshal(b, msg)
	if err == nil {
		return nil
	}
	if field := badUTF8Field(b, msg.ProtoReflect().Descriptor()); field != "" {
		return errdefs.Invalid(field, "is not valid UTF-8; paths, names and commands must be UTF-8 text")
	}
	return err
}

// badUTF8Field returns the name of the first string field of md in the
// wire bytes b holding invalid UTF-8 (the map's name for map keys and
// values), or "".
func badUTF8Field(b []byte, md protoreflect.MessageDescriptor) string {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return ""
		}
		b = b[n:]
		if typ != protowire.BytesType {
			n = protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return ""
			}
			b = b[n:]
			continue
		}
		v, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return ""
		}
		b = b[n:]
		fd := md.Fields().ByNumber(num)
		switch {
		case fd == nil:
		case fd.Kind() == protoreflect.StringKind:
			if !utf8.Valid(v) {
				return string(fd.Name())
			}
		case fd.Kind() == protoreflect.MessageKind:
			if f := badUTF8Field(v, fd.Message()); f != "" {
				if fd.IsMap() {
					return string(fd.Name())
				}
				return f
			}
		}
	}
	return ""
}
