package e2b

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/kernflux/opendsec/internal/errdefs"
	"github.com/kernflux/opendsec/internal/sandboxspec"
)

// maxLabelKey is the longest OpenDsec label key.
const maxLabelKey = sandboxspec.MaxLabelKeyLen

// metaLabel encodes an E2B metadata key as an OpenDsec label key: letters,
// digits, '-' and '/' are kept, every other byte becomes ".xx" (hex), so
// "sandbox_test_id" is "e2b.meta/sandbox.5ftest.5fid".
func metaLabel(key string) (string, error) {
	if key == "" {
		return "", errdefs.Invalid("metadata", "has an empty key; give keys like \"user_id\"")
	}
	var b strings.Builder
	b.WriteString(labelMeta)
	for i := 0; i < len(key); i++ {
		c := key[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '/':
			b.WriteByte(c)
		default:
			fmt.Fprintf(&b, ".%02x", c)
		}
	}
	if b.Len() > maxLabelKey {
		return "", errdefs.Invalid("metadata", "key %q is too long; keys may have at most %d plain characters (fewer with punctuation)", key, maxLabelKey-len(labelMeta))
	}
	return b.String(), nil
}

// metaKey decodes a label key made by metaLabel; ok is false for other labels.
func metaKey(label string) (string, bool) {
	enc, ok := strings.CutPrefix(label, labelMeta)
	if !ok {
		return "", false
	}
	var b strings.Builder
	for i := 0; i < len(enc); i++ {
		if enc[i] == '.' && i+2 < len(enc) {
			v, err := strconv.ParseUint(enc[i+1:i+3], 16, 8)
			if err != nil {
				return "", false
			}
			b.WriteByte(byte(v))
			i += 2
			continue
		}
		b.WriteByte(enc[i])
	}
	return b.String(), true
}

// metadataLabels validates E2B metadata and encodes it as labels.
func metadataLabels(md map[string]string, into map[string]string) error {
	if len(md) > MaxMetadata {
		return errdefs.Invalid("metadata", "has %d entries; at most %d are allowed", len(md), MaxMetadata)
	}
	for k, v := range md {
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return errdefs.Invalid("metadata", "key %q: keys and values must be valid UTF-8", k)
		}
		if len(v) > sandboxspec.MaxLabelValueLen {
			return errdefs.Invalid("metadata", "value of %q is %d bytes; at most %d are allowed", k, len(v), sandboxspec.MaxLabelValueLen)
		}
		l, err := metaLabel(k)
		if err != nil {
			return err
		}
		into[l] = v
	}
	return nil
}

// metadataOf decodes the E2B metadata in labels.
func metadataOf(labels map[string]string) map[string]string {
	md := map[string]string{}
	for l, v := range labels {
		if k, ok := metaKey(l); ok {
			md[k] = v
		}
	}
	return md
}
