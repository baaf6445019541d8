package decoder

import (
	"encoding/hex"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgtype"
)

// relation is the decoder's view of one table from its latest Relation message.
type relation struct {
	name   string
	ncols  int
	outbox bool
	// partition: a partition of the outbox, whose rows are outbox rows
	// (see SetPartitions); named: Message.Partition was set on one.
	partition, named bool
	// unplaced: not the outbox nor, as the catalog says now, one of its
	// partitions, yet with the outbox's columns, in the publication of a
	// partitioned outbox that publishes other tables too (see
	// ErrUnplacedTable).
	unplaced bool
	// column positions in the tuple; -1 when absent
	id, aggType, aggID, evType, payload, headers int
	payloadBytea                                 bool
	// trim: the aggregate type, aggregate id or event type (in fill's
	// order, after the id) is char(n), whose values arrive space-padded.
	trim    [4]bool
	problem string // why rows of this relation cannot be decoded
	// subjects caches the valid subjects by aggregate and event type (most
	// outboxes have a handful): no validation and no string per event.
	subjects map[subjectKey]string
	// shared: one relation value for every decoder (logical decoding
	// messages); it keeps no cache.
	shared bool
}

type subjectKey struct{ aggType, evType string }

// maxSubjects bounds the subject cache of a relation.
const maxSubjects = 4096

var (
	textTypes    = map[uint32]bool{oidText: true, oidVarchar: true, oidBpchar: true, oidName: true}
	idTypes      = map[uint32]bool{oidUUID: true, oidText: true, oidVarchar: true, oidBpchar: true}
	payloadTypes = map[uint32]bool{oidJSONB: true, oidJSON: true, oidText: true, oidVarchar: true, oidBytea: true}
	headerTypes  = map[uint32]bool{oidJSONB: true, oidJSON: true}
)

func typeName(oid uint32) string {
	if t, ok := pgtype.NewMap().TypeForOID(oid); ok {
		return t.Name
	}
	return fmt.Sprintf("type oid %d", oid)
}

// TableColumn is one column of the outbox table: its name and type OID.
// For a domain, TypeOID is its base type (see BaseType): CheckColumns and
// the decoder judge a column by what its values are.
type TableColumn struct {
	Name    string
	TypeOID uint32
}

// Domains maps the OID of each domain to the type it is declared over
// (pg_type.typbasetype), which may be another domain. pgoutput's Relation
// message gives a domain column the domain's OID.
type Domains map[uint32]uint32

// BaseType returns the type whose values a column of type oid holds: oid
// itself, or for a domain the base type at the end of its chain of domains.
func (d Domains) BaseType(oid uint32) uint32 {
	for range len(d) { // a chain visits each domain once; more is a cycle (bad input)
		base, ok := d[oid]
		if !ok || base == 0 {
			return oid
		}
		oid = base
	}
	return oid
}

// ColumnPositions holds where each outbox column sits in a table; -1 when absent.
type ColumnPositions struct {
	ID, AggregateType, AggregateID, EventType, Payload, Headers int
}

// CheckColumns matches the configured outbox columns against a table's
// columns and returns their positions and every problem found (a missing
// required column, a column of an unsupported type). The headers column is
// optional. The same rules apply at start-up (from the catalog) and to every
// Relation message pgoutput sends after DDL.
func CheckColumns(c Columns, table []TableColumn) (ColumnPositions, []string) {
	var problems []string
	find := func(name string, allowed map[uint32]bool, want string, required bool) int {
		for i, col := range table {
			if col.Name != name {
				continue
			}
			if !allowed[col.TypeOID] {
				problems = append(problems, fmt.Sprintf("column %q is %s, want %s", name, typeName(col.TypeOID), want))
				return -1
			}
			return i
		}
		if required {
			problems = append(problems, fmt.Sprintf("column %q is missing", name))
		}
		return -1
	}
	pos := ColumnPositions{Headers: -1}
	pos.ID = find(c.ID, idTypes, "uuid or text", true)
	pos.AggregateType = find(c.AggregateType, textTypes, "text", true)
	pos.AggregateID = find(c.AggregateID, textTypes, "text", true)
	pos.EventType = find(c.EventType, textTypes, "text", true)
	pos.Payload = find(c.Payload, payloadTypes, "jsonb, json, text or bytea", true)
	if c.Headers != "" {
		pos.Headers = find(c.Headers, headerTypes, "jsonb or json", false)
	}
	return pos, problems
}

// newRelation reads a Relation message; partition: the table is a
// partition of the outbox (see SetPartitions), whose rows are outbox rows.
func (d *Decoder) newRelation(m *pglogrepl.RelationMessage, partition bool) *relation {
	r := &relation{name: m.Namespace + "." + m.RelationName, ncols: len(m.Columns)}
	r.partition = partition
	r.outbox = partition || m.Namespace == d.cfg.Schema && m.RelationName == d.cfg.Table
	table := make([]TableColumn, len(m.Columns))
	for i, col := range m.Columns {
		table[i] = TableColumn{Name: col.Name, TypeOID: d.domains.BaseType(col.DataType)}
	}
	pos, problems := CheckColumns(d.cfg.Columns, table)
	if !r.outbox {
		// Another table of a partitioned outbox's publication with the
		// outbox's columns may have been one of its partitions when its
		// rows were written (detached or dropped since).
		r.unplaced = d.partitions != nil && len(problems) == 0
		return r
	}
	r.id, r.aggType, r.aggID, r.evType, r.payload, r.headers =
		pos.ID, pos.AggregateType, pos.AggregateID, pos.EventType, pos.Payload, pos.Headers
	if r.payload >= 0 {
		r.payloadBytea = table[r.payload].TypeOID == oidBytea
	}
	// The id is not trimmed: it is the Nats-Msg-Id, and rows published
	// before would change ids (no dedup of their replays).
	for k, i := range [4]int{-1, r.aggType, r.aggID, r.evType} {
		r.trim[k] = i >= 0 && table[i].TypeOID == oidBpchar
	}
	if len(problems) > 0 {
		r.problem = strings.Join(problems, "; ")
	}
	return r
}

// InvalidEventError is an outbox row that cannot be published as it is.
// With --on-invalid=stop the forwarder stops on it without confirming past
// the row; with dead-lettering it publishes a dead letter instead (see
// Config.DeadLetter), except for format.ReasonTableChanged.
type InvalidEventError struct {
	ID      string        // the row id, "" when the id itself is the problem
	LSN     pglogrepl.LSN // commit LSN of the row's transaction
	TxIndex int           // position of the row in its transaction
	Code    string        // one of the Reason* constants
	Column  string
	Reason  string
	Hint    string // what the operator or the producer should do
	// Message: the event came from a logical decoding message (an
	// envelope, see DecodeEnvelope), not a table row.
	Message bool
}

func (e *InvalidEventError) Error() string {
	id := e.ID
	if id == "" {
		id = "(none)"
	}
	what := "row"
	if e.Message {
		what = "message"
	}
	s := fmt.Sprintf("outbox %s id=%s in transaction %s (row %d): %s", what, id, e.LSN, e.TxIndex, e.Reason)
	if e.Hint != "" {
		s += ": " + e.Hint
	}
	return s
}

// DeadLetterable reports whether a dead letter may replace the row.
func (e *InvalidEventError) DeadLetterable() bool { return e.Code != format.ReasonTableChanged }

// IgnoredReasons returns every reason a logical decoding message publishes nothing.
func IgnoredReasons() []string {
	return []string{IgnoredHeartbeat, IgnoredNonTransactional, IgnoredOtherPrefix}
}

func invalid(code, col, reason, hint string) *InvalidEventError {
	return &InvalidEventError{Code: code, Column: col, Reason: reason, Hint: hint}
}

// fill copies the columns an event needs out of the tuple. On error, ev
// still holds what could be read (raw values), for a dead letter.
func (r *relation) fill(ev *Event, cols []column, cfg *Config) *InvalidEventError {
	if r.problem != "" {
		return invalid(format.ReasonTableChanged, "", "table "+r.name+" no longer fits the outbox contract: "+r.problem,
			"restore the columns (or point the --*-column flags at the new names) and restart jetbox")
	}
	// The four text columns share one allocation.
	idx := [4]int{r.id, r.aggType, r.aggID, r.evType}
	n := 0
	for _, i := range idx {
		if cols[i].kind == 't' {
			n += len(cols[i].data)
		}
	}
	var b strings.Builder
	b.Grow(n)
	for _, i := range idx {
		if cols[i].kind == 't' {
			b.Write(cols[i].data)
		}
	}
	all := b.String()
	var vals [4]string
	off := 0
	for k, i := range idx {
		if cols[i].kind == 't' {
			vals[k] = all[off : off+len(cols[i].data)]
			off += len(cols[i].data)
			if r.trim[k] {
				vals[k] = trimPad(vals[k])
			}
		}
	}
	ev.ID, ev.AggregateType, ev.AggregateID, ev.EventType = vals[0], vals[1], vals[2], vals[3]
	p := cols[r.payload]
	if p.kind == 't' && !r.payloadBytea {
		ev.Payload = append([]byte(nil), p.data...)
	}
	err := r.check(ev, cols, cfg)
	if err != nil && err.Code != format.ReasonBadID {
		err.ID = ev.ID
	}
	return err
}

// check validates the raw values fill copied and finishes the event.
func (r *relation) check(ev *Event, cols []column, cfg *Config) *InvalidEventError {
	text := func(i int, name, code string) *InvalidEventError {
		switch cols[i].kind {
		case 't':
			return nil
		case 'n':
			return invalid(code, name, fmt.Sprintf("column %q is NULL", name), "make the column NOT NULL and fix the producer")
		default:
			return invalid(code, name, fmt.Sprintf("column %q arrived as %q, not text", name, cols[i].kind), "")
		}
	}
	if err := text(r.id, "id", format.ReasonBadID); err != nil {
		return err
	}
	if ev.ID == "" || !printable(ev.ID) {
		return invalid(format.ReasonBadID, "id", fmt.Sprintf("id %q is empty or holds control characters", ev.ID), "ids become Nats-Msg-Id: use uuid ids")
	}
	if mentionsNATSHeader(ev.ID) {
		return invalid(format.ReasonBadID, "id", fmt.Sprintf("id %q holds \"Nats-\"", ev.ID),
			"ids become Nats-Msg-Id, and NATS servers before 2.11 find their own headers by text search: it could hide the order guard or the next message's Nats-Msg-Id; use uuid ids")
	}
	for _, c := range []struct {
		i    int
		name string
	}{{r.aggType, "aggregate_type"}, {r.aggID, "aggregate_id"}, {r.evType, "event_type"}} {
		if err := text(c.i, c.name, format.ReasonNullColumn); err != nil {
			return err
		}
	}
	if !printable(ev.AggregateID) {
		return invalid(format.ReasonBadAggregateID, "aggregate_id", fmt.Sprintf("aggregate_id %q holds control characters", ev.AggregateID), "it is sent as a header: strip CR, LF and other control characters")
	}
	for _, c := range []struct{ name, v, code string }{{"aggregate_id", ev.AggregateID, format.ReasonBadAggregateID},
		{"aggregate_type", ev.AggregateType, format.ReasonBadSubject}, {"event_type", ev.EventType, format.ReasonBadSubject}} {
		if mentionsNATSHeader(c.v) {
			return invalid(c.code, c.name, fmt.Sprintf("%s %q holds \"Nats-\"", c.name, c.v),
				"it is sent as a header, and NATS servers before 2.11 find their own headers by text search: it could hide Nats-Msg-Id (no dedup) or the order guard")
		}
	}
	// The historical subjects are cached per aggregate and event type
	// (validating them costs more than the rest of a row); a template's,
	// which may hold the aggregate id, are rendered per event.
	key := subjectKey{ev.AggregateType, ev.EventType}
	subject, ok := "", false
	cache := cfg.Subjects == nil && r != nil && !r.shared
	if cache {
		subject, ok = r.subjects[key]
	}
	if !ok {
		var serr error
		if subject, serr = cfg.subject(ev); serr != nil {
			if cfg.Subjects == nil {
				return invalid(format.ReasonBadSubject, "", serr.Error(), "aggregate_type and event_type must each be one NATS subject token: no spaces, '.', '*', '>' or control characters, and not starting with '_' (jetbox's own subjects)")
			}
			return invalid(format.ReasonBadSubject, "", serr.Error(), "every value the subject template "+cfg.Subjects.String()+" uses must be one NATS subject token: no spaces, '.', '*', '>' or control characters, and none that starts a token with '_' (jetbox's own subjects)")
		}
		if max := cfg.MaxSubjectLength; max > 0 && len(subject) > max {
			return invalid(format.ReasonBadSubject, "", fmt.Sprintf("subject %s... is %d bytes, over the limit of %d (the NATS server's max_control_line less the reply subject and sizes: a longer line makes the server close the connection)", truncate(subject, 64), len(subject), max),
				"keep the values the subject holds (aggregate_type, event_type, aggregate_id with {aggregate_id}) short, or raise max_control_line on the NATS server and --nats-max-control-line with it")
		}
		if dl := cfg.DeadLetterSubject; dl != "" && strings.HasPrefix(subject, dl+".") {
			return invalid(format.ReasonBadSubject, "", fmt.Sprintf("subject %s is inside the dead-letter subjects %s.>", subject, dl), "use another aggregate_type, or another --dead-letter-subject")
		}
		if cache {
			if r.subjects == nil || len(r.subjects) >= maxSubjects {
				r.subjects = make(map[subjectKey]string) // bounded: start over
			}
			// Own copies for the key: the event's strings share its id's allocation.
			r.subjects[subjectKey{strings.Clone(key.aggType), strings.Clone(key.evType)}] = subject
		}
	}
	ev.Subject = subject

	p := cols[r.payload]
	switch p.kind {
	case 't':
		if r.payloadBytea {
			b, derr := decodeByteaHex(p.data)
			if derr != nil {
				ev.Payload = append([]byte(nil), p.data...)
				return invalid(format.ReasonBadPayload, "payload", "bytea payload: "+derr.Error(), "jetbox sets bytea_output=hex on its connection; report this as a bug")
			}
			ev.Payload = b
		}
	case 'n':
		return invalid(format.ReasonNullPayload, "payload", "payload is NULL", "make the payload column NOT NULL and fix the producer")
	default:
		return invalid(format.ReasonBadPayload, "payload", fmt.Sprintf("payload arrived as %q, not text", p.kind), "")
	}

	if r.headers >= 0 {
		h := cols[r.headers]
		if h.kind == 't' {
			hs, herr := parseHeaders(h.data)
			if herr != nil {
				ev.rawHeaders = string(h.data)
				return invalid(format.ReasonBadHeaders, "headers", herr.Error(), "write a JSON object of string values, e.g. {\"traceparent\":\"00-...\"}")
			}
			ev.Headers = hs
		} else if h.kind != 'n' {
			return invalid(format.ReasonBadHeaders, "headers", fmt.Sprintf("headers arrived as %q, not text", h.kind), "")
		}
	}
	return cfg.checkSize(ev)
}

// checkSize refuses an event whose message is over MaxMessageSize.
func (c *Config) checkSize(ev *Event) *InvalidEventError {
	if size, max := c.size(ev), c.MaxMessageSize; max > 0 && size > max {
		return invalid(format.ReasonTooLarge, "payload", fmt.Sprintf("message of at least %d bytes (payload %d) is over the limit of %d bytes (the server's max_payload or the stream's max_msg_size)", size, len(ev.Payload), max),
			"raise max_payload on the NATS server (and the stream's max_msg_size), or keep outbox payloads smaller (e.g. a CHECK on octet_length(payload))")
	}
	return nil
}

// decodeByteaHex decodes Postgres' hex bytea output (\x0a0b...).
func decodeByteaHex(src []byte) ([]byte, error) {
	if len(src) < 2 || src[0] != '\\' || src[1] != 'x' {
		return nil, fmt.Errorf("not in hex format")
	}
	out := make([]byte, hex.DecodedLen(len(src)-2))
	if _, err := hex.Decode(out, src[2:]); err != nil {
		return nil, err
	}
	return out, nil
}

// truncate returns s cut to at most n bytes, on a rune boundary.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// trimPad removes the trailing spaces char(n) pads its values with (they
// are not part of the value: 'order'::char(8) = 'order').
func trimPad(s string) string { return strings.TrimRight(s, " ") }

// printable reports whether s has no ASCII control characters.
func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] == 0x7f {
			return false
		}
	}
	return true
}
