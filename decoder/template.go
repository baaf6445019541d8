package decoder

import (
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
)

// DefaultSubjectTemplate gives jetbox's historical subjects,
// <prefix>.<aggregate_type>.<event_type>.
const DefaultSubjectTemplate = "{prefix}.{aggregate_type}.{event_type}"

// Template tokens.
const (
	TokenPrefix        = "{prefix}"
	TokenAggregateType = "{aggregate_type}"
	TokenAggregateID   = "{aggregate_id}"
	TokenEventType     = "{event_type}"
	TokenPartition     = "{partition}"
)

// Template renders the subject of an event: dot-separated tokens, each a
// literal or made of literals and placeholders ({aggregate_type},
// {aggregate_id}, {event_type}, {partition}); {prefix} (the subject
// prefix, which may hold several tokens) must be the first token, alone, so
// that every subject stays under <prefix>.> (the stream check, the publish
// permission and the resume tip all rely on it). It is immutable once parsed.
type Template struct {
	text       string
	tokens     [][]piece // after {prefix}
	partitions int
	usesID     bool
}

// piece is a literal (field "") or a placeholder.
type piece struct{ lit, field string }

// ParseTemplate parses and validates a subject template. partitions is N
// for {partition} (hash of aggregate_id modulo N, see Partition): a
// template with {partition} needs N ≥ 1, and N ≥ 1 needs {partition}.
func ParseTemplate(text string, partitions int) (*Template, error) {
	if partitions < 0 {
		return nil, fmt.Errorf("partitions %d is negative", partitions)
	}
	toks := strings.Split(text, ".")
	if toks[0] != TokenPrefix {
		return nil, fmt.Errorf("subject template %q must start with the token %s (every subject stays under <prefix>.>)", text, TokenPrefix)
	}
	if len(toks) < 2 {
		return nil, fmt.Errorf("subject template %q has no token after %s", text, TokenPrefix)
	}
	t := &Template{text: text, partitions: partitions}
	hasPartition := false
	for i, tok := range toks[1:] {
		pieces, err := parseToken(tok)
		if err != nil {
			return nil, fmt.Errorf("subject template %q, token %d %q: %w", text, i+2, tok, err)
		}
		if i == 0 && len(pieces) > 0 && pieces[0].field == "" && strings.HasPrefix(pieces[0].lit, "_") {
			return nil, fmt.Errorf("subject template %q: the token after %s may not start with '_' (jetbox's own subjects, such as the dead letters <prefix>._dlq, live there)", text, TokenPrefix)
		}
		for _, p := range pieces {
			switch p.field {
			case TokenPartition:
				hasPartition = true
			case TokenAggregateID:
				t.usesID = true
			}
		}
		t.tokens = append(t.tokens, pieces)
	}
	switch {
	case hasPartition && partitions < 1:
		return nil, fmt.Errorf("subject template %q uses %s but the number of partitions is %d: set it to 1 or more", text, TokenPartition, partitions)
	case !hasPartition && partitions > 0:
		return nil, fmt.Errorf("%d partitions are set but subject template %q has no %s token: add it (e.g. {prefix}.{aggregate_type}.{partition}.{event_type}) or set partitions to 0", partitions, text, TokenPartition)
	}
	return t, nil
}

func parseToken(tok string) ([]piece, error) {
	if tok == "" {
		return nil, fmt.Errorf("empty token (two dots, or a dot at an end)")
	}
	var out []piece
	for tok != "" {
		open := strings.IndexByte(tok, '{')
		if close := strings.IndexByte(tok, '}'); close >= 0 && (open < 0 || close < open) {
			return nil, fmt.Errorf("'}' without '{'")
		}
		if open < 0 {
			out = append(out, piece{lit: tok})
			break
		}
		if open > 0 {
			out = append(out, piece{lit: tok[:open]})
		}
		end := strings.IndexByte(tok[open:], '}')
		if end < 0 {
			return nil, fmt.Errorf("'{' without '}'")
		}
		name := tok[open : open+end+1]
		switch name {
		case TokenAggregateType, TokenAggregateID, TokenEventType, TokenPartition:
			out = append(out, piece{field: name})
		case TokenPrefix:
			return nil, fmt.Errorf("%s may only be the first token", TokenPrefix)
		default:
			return nil, fmt.Errorf("unknown placeholder %s (known: %s %s %s %s %s)", name, TokenPrefix, TokenAggregateType, TokenAggregateID, TokenEventType, TokenPartition)
		}
		tok = tok[open+end+1:]
	}
	for _, p := range out {
		if p.field == "" {
			if err := validToken(p.lit); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

// String returns the template's text.
func (t *Template) String() string { return t.text }

// Partitions returns N of {partition}; 0 when the template has none.
func (t *Template) Partitions() int { return t.partitions }

// UsesAggregateID reports whether subjects hold the aggregate id.
func (t *Template) UsesAggregateID() bool { return t.usesID }

// Filter returns the subject filter that matches exactly the subjects the
// template can produce under prefix: each token holding a placeholder
// becomes '*' (every placeholder value is one token), e.g. "outbox.*.*".
func (t *Template) Filter(prefix string) string {
	var b strings.Builder
	b.WriteString(prefix)
	for _, pieces := range t.tokens {
		b.WriteByte('.')
		wild := false
		for _, p := range pieces {
			wild = wild || p.field != ""
		}
		if wild {
			b.WriteByte('*')
		} else {
			b.WriteString(pieces[0].lit)
		}
	}
	return b.String()
}

// Render returns ev's subject under prefix. Every placeholder value must be
// one valid subject token (not empty, no '.', '*', '>', whitespace or
// control characters); otherwise the error names the field.
func (t *Template) Render(prefix string, ev *Event) (string, error) {
	var b strings.Builder
	b.Grow(len(prefix) + len(ev.AggregateType) + len(ev.EventType) + len(ev.AggregateID) + 8*len(t.tokens))
	b.WriteString(prefix)
	for _, pieces := range t.tokens {
		b.WriteByte('.')
		for j, p := range pieces {
			var v, name string
			switch p.field {
			case "":
				b.WriteString(p.lit)
				continue
			case TokenAggregateType:
				v, name = ev.AggregateType, "aggregate_type"
			case TokenEventType:
				v, name = ev.EventType, "event_type"
			case TokenAggregateID:
				v, name = ev.AggregateID, "aggregate_id"
			case TokenPartition:
				b.WriteString(strconv.Itoa(Partition(ev.AggregateID, t.partitions)))
				continue
			}
			if err := validValue(v, j == 0); err != nil {
				return "", fmt.Errorf("%s %q: %w", name, v, err)
			}
			b.WriteString(v)
		}
	}
	return b.String(), nil
}

// Partition returns the partition of an aggregate: the 32-bit FNV-1a hash
// of the aggregate id's UTF-8 bytes, modulo n (0 when n < 1). It is the
// function nats-server applies in a subject transform's
// {{partition(n,i)}} to one token, so a stream mapping
// <prefix>.<type>.<id>.> with {{partition(n,3)}} computes the same value.
// Any language computes it with a standard FNV-1a (offset basis 2166136261,
// prime 16777619).
func Partition(aggregateID string, n int) int {
	if n < 1 {
		return 0
	}
	h := fnv.New32a()
	_, _ = h.Write([]byte(aggregateID))
	return int(h.Sum32() % uint32(n))
}
