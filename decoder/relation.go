package decoder

import (
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgtype"
)

// relation is the decoder's view of one table from its latest Relation message.
type relation struct {
	name   string
	ncols  int
	outbox bool
	// column positions in the tuple; -1 when absent
	id, aggType, aggID, evType, payload, headers int
	payloadBytea                                 bool
	problem                                      string // why rows of this relation cannot be decoded
}

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
type TableColumn struct {
	Name    string
	TypeOID uint32
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

func (d *Decoder) newRelation(m *pglogrepl.RelationMessage) *relation {
	r := &relation{name: m.Namespace + "." + m.RelationName, ncols: len(m.Columns)}
	r.outbox = m.Namespace == d.cfg.Schema && m.RelationName == d.cfg.Table
	if !r.outbox {
		return r
	}
	table := make([]TableColumn, len(m.Columns))
	for i, col := range m.Columns {
		table[i] = TableColumn{Name: col.Name, TypeOID: col.DataType}
	}
	pos, problems := CheckColumns(d.cfg.Columns, table)
	r.id, r.aggType, r.aggID, r.evType, r.payload, r.headers =
		pos.ID, pos.AggregateType, pos.AggregateID, pos.EventType, pos.Payload, pos.Headers
	if r.payload >= 0 {
		r.payloadBytea = m.Columns[r.payload].DataType == oidBytea
	}
	if len(problems) > 0 {
		r.problem = strings.Join(problems, "; ")
	}
	return r
}

// InvalidEventError is an outbox row that cannot be published as it is.
// The forwarder stops on it without confirming past the row.
type InvalidEventError struct {
	ID      string        // the row id, "" when the id itself is the problem
	LSN     pglogrepl.LSN // commit LSN of the row's transaction
	TxIndex int           // position of the row in its transaction
	Column  string
	Reason  string
	Hint    string // what the operator or the producer should do
}

func (e *InvalidEventError) Error() string {
	id := e.ID
	if id == "" {
		id = "(none)"
	}
	s := fmt.Sprintf("outbox row id=%s in transaction %s (row %d): %s", id, e.LSN, e.TxIndex, e.Reason)
	if e.Hint != "" {
		s += ": " + e.Hint
	}
	return s
}

func invalid(col, reason, hint string) *InvalidEventError {
	return &InvalidEventError{Column: col, Reason: reason, Hint: hint}
}

// fill copies the columns an event needs out of the tuple.
func (r *relation) fill(ev *Event, cols []column, prefix string) *InvalidEventError {
	if r.problem != "" {
		return invalid("", "table "+r.name+" no longer fits the outbox contract: "+r.problem,
			"restore the columns (or point the --*-column flags at the new names) and restart jetbox")
	}
	text := func(i int, name string) (string, *InvalidEventError) {
		c := cols[i]
		switch c.kind {
		case 't':
			return string(c.data), nil
		case 'n':
			return "", invalid(name, fmt.Sprintf("column %q is NULL", name), "make the column NOT NULL and fix the producer")
		default:
			return "", invalid(name, fmt.Sprintf("column %q arrived as %q, not text", name, c.kind), "")
		}
	}
	var err *InvalidEventError
	if ev.ID, err = text(r.id, "id"); err != nil {
		return err
	}
	if ev.ID == "" || !printable(ev.ID) {
		id := ev.ID
		ev.ID = ""
		return invalid("id", fmt.Sprintf("id %q is empty or holds control characters", id), "ids become Nats-Msg-Id: use uuid ids")
	}
	fail := func(e *InvalidEventError) *InvalidEventError { e.ID = ev.ID; return e }
	if ev.AggregateType, err = text(r.aggType, "aggregate_type"); err != nil {
		return fail(err)
	}
	if ev.AggregateID, err = text(r.aggID, "aggregate_id"); err != nil {
		return fail(err)
	}
	if ev.EventType, err = text(r.evType, "event_type"); err != nil {
		return fail(err)
	}
	if !printable(ev.AggregateID) {
		return fail(invalid("aggregate_id", fmt.Sprintf("aggregate_id %q holds control characters", ev.AggregateID), "it is sent as a header: strip CR, LF and other control characters"))
	}
	subject, serr := Subject(prefix, ev.AggregateType, ev.EventType)
	if serr != nil {
		return fail(invalid("", serr.Error(), "aggregate_type and event_type must each be one NATS subject token: no spaces, '.', '*', '>' or control characters"))
	}
	ev.Subject = subject

	p := cols[r.payload]
	switch p.kind {
	case 't':
		if r.payloadBytea {
			b, derr := decodeByteaHex(p.data)
			if derr != nil {
				return fail(invalid("payload", "bytea payload: "+derr.Error(), "jetbox sets bytea_output=hex on its connection; report this as a bug"))
			}
			ev.Payload = b
		} else {
			ev.Payload = append([]byte(nil), p.data...)
		}
	case 'n':
		return fail(invalid("payload", "payload is NULL", "make the payload column NOT NULL and fix the producer"))
	default:
		return fail(invalid("payload", fmt.Sprintf("payload arrived as %q, not text", p.kind), ""))
	}

	if r.headers >= 0 {
		h := cols[r.headers]
		if h.kind == 't' {
			hs, herr := parseHeaders(h.data)
			if herr != nil {
				return fail(invalid("headers", herr.Error(), "write a JSON object of string values, e.g. {\"traceparent\":\"00-...\"}"))
			}
			ev.Headers = hs
		} else if h.kind != 'n' {
			return fail(invalid("headers", fmt.Sprintf("headers arrived as %q, not text", h.kind), ""))
		}
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

// printable reports whether s has no ASCII control characters.
func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] == 0x7f {
			return false
		}
	}
	return true
}
