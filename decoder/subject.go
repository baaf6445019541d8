package decoder

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/jetbox-dev/jetbox/sink/format"
)

// Subject returns "<prefix>.<aggregateType>.<eventType>", or an error when a
// part is not a valid NATS subject token. The prefix may hold several tokens.
func Subject(prefix, aggregateType, eventType string) (string, error) {
	if err := ValidPrefix(prefix); err != nil {
		return "", err
	}
	if err := validValue(aggregateType, true); err != nil {
		return "", fmt.Errorf("aggregate_type %q: %w", aggregateType, err)
	}
	if err := validValue(eventType, true); err != nil {
		return "", fmt.Errorf("event_type %q: %w", eventType, err)
	}
	return prefix + "." + aggregateType + "." + eventType, nil
}

// subject renders ev's subject with the configured template.
func (c *Config) subject(ev *Event) (string, error) {
	if c.Subjects == nil {
		return Subject(c.SubjectPrefix, ev.AggregateType, ev.EventType)
	}
	if err := ValidPrefix(c.SubjectPrefix); err != nil {
		return "", err
	}
	return c.Subjects.Render(c.SubjectPrefix, ev)
}

// ValidPrefix checks a subject prefix: one or more dot-separated tokens.
func ValidPrefix(prefix string) error {
	if prefix == "" {
		return fmt.Errorf("subject prefix is empty")
	}
	for _, tok := range strings.Split(prefix, ".") {
		if err := validToken(tok); err != nil {
			return fmt.Errorf("subject prefix %q: %w", prefix, err)
		}
	}
	return nil
}

// validValue checks a row's value as (part of) a subject token; first: it
// starts the token. A token after the prefix that starts with '_' is
// jetbox's own (the dead letters <prefix>._dlq, the atomic probe
// <prefix>._jetbox...), so a value may not start one: aggregate_type
// "_dlq" would land among the dead letters consumers filter out.
func validValue(v string, first bool) error {
	if err := validToken(v); err != nil {
		return err
	}
	if first && strings.HasPrefix(v, "_") {
		return fmt.Errorf("starts with '_', which marks jetbox's own subjects (<prefix>.%s, <prefix>.%s...)", format.DeadLetterToken, format.ProbeToken)
	}
	return nil
}

func validToken(tok string) error {
	if tok == "" {
		return fmt.Errorf("empty subject token")
	}
	if !utf8.ValidString(tok) {
		return fmt.Errorf("not valid UTF-8")
	}
	for _, r := range tok {
		switch {
		case r == '.' || r == '*' || r == '>':
			return fmt.Errorf("holds %q, which NATS subjects reserve", r)
		case r <= ' ' || r == 0x7f:
			return fmt.Errorf("holds whitespace or a control character")
		}
	}
	return nil
}

// reservedHeader reports header names a row may not set: NATS and JetStream
// interpret Nats-* headers, and Jetbox-* headers are jetbox's own.
func reservedHeader(k string) bool {
	l := strings.ToLower(k)
	return strings.HasPrefix(l, "nats-") || strings.HasPrefix(l, "jetbox-")
}

// parseHeaders reads the headers column: a JSON object whose string values are
// copied as message headers (sorted by key, for a stable order). A null
// value is no header; a number, boolean, array or object is an error (it
// would otherwise be dropped silently). null or {} gives none.
func parseHeaders(src []byte) ([]Header, error) {
	src = bytes.TrimSpace(src)
	if len(src) == 0 || string(src) == "null" {
		return nil, nil
	}
	if src[0] != '{' {
		return nil, fmt.Errorf("headers is not a JSON object")
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(src, &obj); err != nil {
		return nil, fmt.Errorf("headers is not valid JSON: %v", err)
	}
	if len(obj) == 0 {
		return nil, nil
	}
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	out := make([]Header, 0, len(obj))
	for _, k := range keys {
		raw := obj[k]
		if string(raw) == "null" {
			continue
		}
		if len(raw) == 0 || raw[0] != '"' {
			return nil, fmt.Errorf("header %q is %s, not a string (header values are strings: write it as \"...\")", k, jsonKind(raw))
		}
		var v string
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, fmt.Errorf("header %q: %v", k, err)
		}
		if err := validHeaderName(k); err != nil {
			return nil, err
		}
		if reservedHeader(k) {
			return nil, fmt.Errorf("header %q is reserved (Nats-* and Jetbox-* are set by jetbox and JetStream)", k)
		}
		if mentionsNATSHeader(k) {
			return nil, fmt.Errorf("header name %q holds \"Nats-\": NATS servers before 2.11 find their headers by text search, so it could hide Nats-Msg-Id (no dedup) or the order guard; rename it", k)
		}
		if !printable(v) {
			return nil, fmt.Errorf("header %q value holds control characters (CR, LF...)", k)
		}
		if mentionsNATSHeader(v) {
			return nil, fmt.Errorf("header %q value holds \"Nats-\": NATS servers before 2.11 find their headers by text search, so it could hide Nats-Msg-Id (no dedup) or the order guard", k)
		}
		out = append(out, Header{Key: k, Value: v})
	}
	return out, nil
}

func jsonKind(raw json.RawMessage) string {
	switch {
	case len(raw) == 0:
		return "empty"
	case raw[0] == '{':
		return "an object"
	case raw[0] == '[':
		return "an array"
	case raw[0] == 't' || raw[0] == 'f':
		return "a boolean"
	default:
		return "a number"
	}
}

// mentionsNATSHeader reports whether a header name or value holds "Nats-":
// nats-server 2.10 looks its headers (all named Nats-...) up with a plain,
// case-sensitive text search over the header block, so such a text placed
// before the real header hides it (see TestServerHeaderSearch in sink; other
// spellings, such as nats-, do not).
func mentionsNATSHeader(v string) bool { return strings.Contains(v, "Nats-") }

func validHeaderName(k string) error {
	if k == "" {
		return fmt.Errorf("header name is empty")
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if c <= ' ' || c >= 0x7f || c == ':' {
			return fmt.Errorf("header name %q must be printable ASCII without spaces or ':'", k)
		}
	}
	return nil
}
