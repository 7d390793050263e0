package spectest

import (
	"fmt"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Fill sets every field of m, recursively, to a non-zero value derived from
// the field (so two fields never share a value by accident): a mapping
// test that fills its input this way fails when a field is added to a
// message and forgotten in the mapping. Lists get two elements, maps one
// entry, enums their last value. It panics on a kind it does not know
// (extend it then).
func Fill[M proto.Message](m M) M {
	fill(m.ProtoReflect(), 0)
	return m
}

func fill(m protoreflect.Message, depth int) {
	if depth > 8 {
		panic(fmt.Sprintf("spectest.Fill: %s nests too deep (recursive message?)", m.Descriptor().FullName()))
	}
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		switch {
		case fd.IsMap():
			mp := m.Mutable(fd).Map()
			k := scalar(fd.MapKey(), string(fd.Name())+"-k").MapKey()
			if fd.MapValue().Message() != nil {
				fill(mp.Mutable(k).Message(), depth+1)
			} else {
				mp.Set(k, scalar(fd.MapValue(), string(fd.Name())+"-v"))
			}
		case fd.IsList():
			l := m.Mutable(fd).List()
			for j := range 2 {
				if fd.Message() != nil {
					fill(l.AppendMutable().Message(), depth+1)
				} else {
					l.Append(scalar(fd, fmt.Sprintf("%s-%d", fd.Name(), j)))
				}
			}
		case fd.Message() != nil:
			fill(m.Mutable(fd).Message(), depth+1)
		default:
			m.Set(fd, scalar(fd, string(fd.Name())+"-value"))
		}
	}
}

// scalar is a non-zero value of fd's kind; s is used for strings and
// bytes, fd's number for numbers.
func scalar(fd protoreflect.FieldDescriptor, s string) protoreflect.Value {
	n := int64(fd.Number())
	switch fd.Kind() {
	case protoreflect.StringKind:
		return protoreflect.ValueOfString(s)
	case protoreflect.BytesKind:
		return protoreflect.ValueOfBytes([]byte(s))
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(true)
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(int32(100 + n))
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(100 + n)
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(uint32(100 + n))
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return protoreflect.ValueOfUint64(uint64(100 + n))
	case protoreflect.DoubleKind:
		return protoreflect.ValueOfFloat64(float64(n) + 0.5)
	case protoreflect.FloatKind:
		return protoreflect.ValueOfFloat32(float32(n) + 0.5)
	case protoreflect.EnumKind:
		vs := fd.Enum().Values()
		return protoreflect.ValueOfEnum(vs.Get(vs.Len() - 1).Number())
	}
	panic(fmt.Sprintf("spectest.Fill: field %s has kind %s, which Fill does not know; extend it", fd.FullName(), fd.Kind()))
}
