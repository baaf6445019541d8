// Package decoder turns pgoutput (protocol version 1) messages into outbox
// events. It is pure: no I/O, no goroutines, one Decoder per replication
// session (it owns the relation cache, which pgoutput resends on every new
// session and after every DDL).
//
// With pgoutput streaming off, a transaction is sent only after it committed,
// so each insert becomes an Event the moment it arrives; nothing is buffered
// per transaction. Malformed input returns an error and never panics.
package decoder

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
)

// Postgres type OIDs the decoder accepts for outbox columns.
const (
	oidBytea   = 17
	oidName    = 19
	oidText    = 25
	oidJSON    = 114
	oidBpchar  = 1042
	oidVarchar = 1043
	oidUUID    = 2950
	oidJSONB   = 3802
)

// Columns names the outbox columns the decoder reads.
type Columns struct {
	ID            string // uuid or text; becomes Nats-Msg-Id
	AggregateType string // text; second subject token
	AggregateID   string // text
	EventType     string // text; third subject token
	Payload       string // jsonb, json, text or bytea; the message data
	Headers       string // optional jsonb/json object of string values; "" disables
}

// DefaultColumns is the column set of the outbox DDL in the README.
var DefaultColumns = Columns{
	ID: "id", AggregateType: "aggregate_type", AggregateID: "aggregate_id",
	EventType: "event_type", Payload: "payload", Headers: "headers",
}

// Config says which table is the outbox and how its rows become events.
type Config struct {
	Schema        string // e.g. "public"
	Table         string // e.g. "outbox"
	Columns       Columns
	SubjectPrefix string // e.g. "outbox"
	// DeadLetterSubject, when set, turns a row that cannot be published into
	// a dead letter on <DeadLetterSubject>.<reason> (see DeadLetter) instead
	// of an error. Empty: Decode returns the *InvalidEventError (stop).
	DeadLetterSubject string
	// MaxMessageSize is the largest message the server and the stream take;
	// a larger row is invalid (format.ReasonTooLarge). 0: no check.
	MaxMessageSize int
	// Size returns the bytes an event's message takes against
	// MaxMessageSize, as the sink sends it (sink.MessageSize): a lower
	// bound, never more, so no row that fits is refused (the sink refuses
	// exactly what is still too large). nil: the payload and the row's
	// headers only.
	Size func(*Event) int
	// MaxSubjectLength is the longest subject the server takes (see
	// sink.Publisher.SubjectLimit: NATS' max_control_line less the reply
	// subject and sizes on the same line); a longer one is invalid
	// (format.ReasonBadSubject). 0: no check.
	MaxSubjectLength int
	// Subjects renders each event's subject (see ParseTemplate); nil:
	// DefaultSubjectTemplate.
	Subjects *Template
	// MessagePrefix, when set, makes transactional logical decoding
	// messages (pg_logical_emit_message(true, MessagePrefix, envelope))
	// outbox events, like rows (see DecodeEnvelope). Other prefixes, and
	// non-transactional messages, publish nothing (Message.Ignored says
	// why). Empty: messages are not a source (pgoutput sends none then).
	MessagePrefix string
	// Atomic: the sink stores each transaction as atomic batches, and its
	// messages say so in Jetbox-Routing (see RoutingHeader).
	Atomic bool
}

// IndexScheme names how Event.TxIndex counts a transaction's events: "" when
// only the table's rows count (--source=table, the default), else
// "table,messages:<prefix>" or "messages:<prefix>" (rows and messages of that
// prefix count together). The same WAL read under two schemes can give a row
// two indexes; messages published under a non-empty scheme carry it in the
// Jetbox-Index-Scheme header, so a restart can tell (replication checks it).
func (c Config) IndexScheme() string {
	switch {
	case c.MessagePrefix == "":
		return ""
	case c.Table == "":
		return "messages:" + c.MessagePrefix
	}
	return "table,messages:" + c.MessagePrefix
}

// size is ev's message size against MaxMessageSize (see Size).
func (c *Config) size(ev *Event) int {
	if c.Size != nil {
		return c.Size(ev)
	}
	n := len(ev.Payload)
	for _, h := range ev.Headers {
		n += len(h.Key) + len(h.Value) + 4
	}
	return n
}

// perPublishHeaders is what one publish may add to a message besides what
// Size counts: the order guard's expected sequence and last id (the
// previous row's id, here up to 150 bytes), a trace context, an atomic
// batch's headers. A dead letter's payload is left out unless it fits
// with them.
const perPublishHeaders = 512

// Kind says what a decoded message means to the forwarder.
type Kind int

// The kinds of Message.
const (
	KindNone   Kind = iota // nothing to do (relation, type, other tables, updates...)
	KindBegin              // a transaction starts
	KindEvent              // an outbox insert: Message.Event is set
	KindCommit             // a transaction ended: Message.EndLSN is set
)

// Message is the result of decoding one pgoutput message.
type Message struct {
	Kind  Kind
	Event Event
	// EndLSN is the transaction's end LSN (Commit.TransactionEndLSN): the
	// position to confirm once every event of the transaction is acked.
	EndLSN pglogrepl.LSN
	// CommitLSN is the transaction's commit LSN (where its commit record
	// starts), set with KindBegin and KindCommit.
	CommitLSN pglogrepl.LSN
	// Ignored is set (with KindNone) on a logical decoding message that
	// publishes nothing: one of the Ignored* reasons.
	Ignored string
	// Partition is set (with KindEvent) on the first row of a partition of
	// the outbox ("schema.name") since its Relation message: pgoutput names
	// the outbox's rows after their partition (the publication lacks
	// publish_via_partition_root), and they are decoded as outbox rows.
	Partition string
}

// Event is one outbox row ready to publish.
type Event struct {
	ID            string
	Subject       string
	AggregateType string
	AggregateID   string
	EventType     string
	Payload       []byte
	Headers       []Header // string values of the row's headers object, in key order
	CommitLSN     pglogrepl.LSN
	CommitTime    time.Time
	TxIndex       int // position of the row in its transaction, from 0
	XID           uint32
	// Origin identifies the WAL history the event comes from
	// ("<system id>/<timeline>/<database>/<slot>"); set by replication.
	Origin string
	// DeadLetter is set on a dead letter: why the row it stands for could
	// not be published.
	DeadLetter *InvalidEventError
	// Decoded is when replication decoded the event, set only when it is
	// traced (replication.Config.StampDecoded): its span starts there, so
	// it shows the wait for the in-flight window too.
	Decoded time.Time
	// WALSent is when the walsender sent the message that carried the event
	// (XLogData's send time, the server's clock), set with Decoded: from it
	// to Decoded is the time in the socket and jetbox's read buffer.
	WALSent time.Time

	rawHeaders string // the headers column when it was the problem
	// messagePrefix is set on an event from a logical decoding message
	// (the message's prefix); "" for a table row.
	messagePrefix string
}

// Header is one user header copied from the row's headers column.
type Header struct{ Key, Value string }

// OutboxIdentity tells which table the outbox is: its relation OID, read
// from the catalog when the WAL was at LSN. A table dropped and recreated
// under the same name has a new OID, and the rows written to it before it
// was added to the publication were never streamed. Rows committed before
// LSN may come from an older table of that name (history, not checked).
type OutboxIdentity struct {
	OID uint32 // 0: unknown, nothing is checked
	LSN pglogrepl.LSN
}

// ErrUnplacedTable marks a row of a table with the outbox's columns, in
// the publication of a partitioned outbox that also publishes other
// tables, which the catalog does not place under the outbox: it may have
// been one of its partitions when the row was written (detached or
// dropped since, and pgoutput streams by the catalog of then), or another
// table. jetbox cannot tell, and stops rather than lose outbox rows.
var ErrUnplacedTable = errors.New("a table with the outbox's columns that the catalog does not place under the outbox")

// ErrTableReplaced marks a Relation message for the outbox table with
// another relation OID than the one it had (see OutboxIdentity).
var ErrTableReplaced = errors.New("outbox table replaced")

// Decoder decodes pgoutput messages of one replication session.
type Decoder struct {
	cfg       Config
	relations map[uint32]*relation
	outbox    OutboxIdentity
	domains   Domains
	// partitions: the OIDs of the outbox's partitions (see SetPartitions).
	partitions map[uint32]bool
	lookup     PartitionLookup

	inTxn      bool
	commitLSN  pglogrepl.LSN
	commitTime time.Time
	xid        uint32
	index      int

	cols   []column // splitTuple's storage, reused for every insert
	origin string   // Event.Origin of every event (SetOrigin)
}

// New returns a decoder for cfg. Call Validate on cfg first.
func New(cfg Config) *Decoder {
	return &Decoder{cfg: cfg, relations: make(map[uint32]*relation)}
}

// SetOutbox sets which table the outbox is (see OutboxIdentity); from then
// on a Relation message for the outbox in a transaction committed after
// id.LSN with another OID is an error wrapping ErrTableReplaced.
func (d *Decoder) SetOutbox(id OutboxIdentity) { d.outbox = id }

// PartitionLookup reports whether the relation with OID oid, named name
// ("schema.table"), is a partition of the outbox, at any depth. An error
// fails the Decode that asked.
type PartitionLookup func(oid uint32, name string) (bool, error)

// SetPartitions tells the decoder the OIDs of a partitioned outbox's
// partitions. A publication without publish_via_partition_root makes
// pgoutput name the outbox's rows after the leaf partition each is stored
// in: the decoder reads them as outbox rows (a partition has the outbox's
// columns). Of a Relation message for any other table, lookup (nil: none)
// is asked whether it is a partition attached since.
func (d *Decoder) SetPartitions(oids []uint32, lookup PartitionLookup) {
	d.partitions = make(map[uint32]bool, len(oids))
	for _, oid := range oids {
		d.partitions[oid] = true
	}
	d.lookup = lookup
}

// SetDomains sets the domains of the database (see Domains); from then on
// a Relation message's domain columns are judged, and read, as their base
// types. A domain it does not know is judged as an unknown type.
func (d *Decoder) SetDomains(domains Domains) { d.domains = domains }

// SetOrigin sets the WAL history (Event.Origin) of the events decoded from
// now on: the sink's headers carry it, so their size counts it.
func (d *Decoder) SetOrigin(origin string) { d.origin = origin }

// InTransaction reports whether a Begin was decoded without its Commit.
func (d *Decoder) InTransaction() bool { return d.inTxn }

// ErrProtocol marks pgoutput input the decoder cannot make sense of.
var ErrProtocol = errors.New("pgoutput protocol error")

// Decode decodes one pgoutput message (the WALData of an XLogData). The
// returned Event owns its memory: data may be reused after Decode returns.
//
// Errors: *InvalidEventError for an outbox row that cannot be published
// (it names the row and the fix); an error wrapping ErrProtocol for malformed
// or unexpected input.
func (d *Decoder) Decode(data []byte) (msg Message, err error) {
	if len(data) == 0 {
		return Message{}, fmt.Errorf("%w: empty message", ErrProtocol)
	}
	defer func() {
		// pglogrepl's decoders index without bounds checks; a short or corrupt
		// message must become an error, never a crash.
		if r := recover(); r != nil {
			msg, err = Message{}, fmt.Errorf("%w: malformed %q message: %v", ErrProtocol, data[0], r)
		}
	}()
	switch pglogrepl.MessageType(data[0]) {
	case pglogrepl.MessageTypeBegin:
		var m pglogrepl.BeginMessage
		if err := m.Decode(data[1:]); err != nil {
			return Message{}, fmt.Errorf("%w: %v", ErrProtocol, err)
		}
		if d.inTxn {
			return Message{}, fmt.Errorf("%w: BEGIN %s inside open transaction %s", ErrProtocol, m.FinalLSN, d.commitLSN)
		}
		d.inTxn, d.commitLSN, d.commitTime, d.xid, d.index = true, m.FinalLSN, m.CommitTime.UTC(), m.Xid, 0
		return Message{Kind: KindBegin, CommitLSN: m.FinalLSN}, nil
	case pglogrepl.MessageTypeCommit:
		var m pglogrepl.CommitMessage
		if err := m.Decode(data[1:]); err != nil {
			return Message{}, fmt.Errorf("%w: %v", ErrProtocol, err)
		}
		if !d.inTxn {
			return Message{}, fmt.Errorf("%w: COMMIT %s without BEGIN", ErrProtocol, m.CommitLSN)
		}
		d.inTxn = false
		return Message{Kind: KindCommit, EndLSN: m.TransactionEndLSN, CommitLSN: m.CommitLSN}, nil
	case pglogrepl.MessageTypeRelation:
		var m pglogrepl.RelationMessage
		if err := m.Decode(data[1:]); err != nil {
			return Message{}, fmt.Errorf("%w: %v", ErrProtocol, err)
		}
		part, err := d.isPartition(&m)
		if err != nil {
			return Message{}, err
		}
		r := d.newRelation(&m, part)
		if r.outbox && !part {
			if err := d.checkOutboxOID(m.RelationID); err != nil {
				return Message{}, err
			}
		}
		d.relations[m.RelationID] = r
		return Message{}, nil
	case pglogrepl.MessageTypeInsert:
		return d.decodeInsert(data[1:])
	case pglogrepl.MessageTypeUpdate, pglogrepl.MessageTypeDelete, pglogrepl.MessageTypeTruncate,
		pglogrepl.MessageTypeType, pglogrepl.MessageTypeOrigin:
		return Message{}, nil // outbox updates and deletes publish nothing
	case pglogrepl.MessageTypeMessage:
		if d.cfg.MessagePrefix == "" {
			return Message{}, nil // messages are not a source
		}
		return d.decodeMessage(data[1:])
	default:
		return Message{}, fmt.Errorf("%w: unsupported message type %q (is streaming or two_phase on? jetbox needs both off)", ErrProtocol, data[0])
	}
}

// isPartition reports whether a Relation message is for a partition of the
// outbox (see SetPartitions), asking the lookup about a table it does not know.
func (d *Decoder) isPartition(m *pglogrepl.RelationMessage) (bool, error) {
	if d.cfg.Table == "" || m.Namespace == d.cfg.Schema && m.RelationName == d.cfg.Table {
		return false, nil
	}
	if d.partitions[m.RelationID] {
		return true, nil
	}
	if d.lookup == nil {
		return false, nil
	}
	name := m.Namespace + "." + m.RelationName
	ok, err := d.lookup(m.RelationID, name)
	if err != nil {
		return false, fmt.Errorf("tell whether table %s (relation OID %d) is a partition of the outbox %s.%s: %w", name, m.RelationID, d.cfg.Schema, d.cfg.Table, err)
	}
	if ok {
		d.partitions[m.RelationID] = true
	}
	return ok, nil
}

// checkOutboxOID refuses a Relation message for the outbox table whose OID
// is not the table's: the table was dropped and recreated.
func (d *Decoder) checkOutboxOID(oid uint32) error {
	id := d.outbox
	if id.OID == 0 || oid == id.OID || !d.inTxn || d.commitLSN <= id.LSN {
		return nil
	}
	at := d.commitTime.Format(time.RFC3339Nano)
	return fmt.Errorf("%w: table %s.%s was dropped and recreated while jetbox ran (relation OID %d when jetbox started, %d in transaction %s committed at %s): Postgres streams a new table only from the moment it is added to the publication, so rows inserted into it before then were never streamed, and jetbox stops rather than lose them silently; "+
		"fix: re-insert, with their ids, the rows of %s.%s committed before %s that the stream lacks (the stream dedups those it has), then restart jetbox, which goes on from this transaction",
		ErrTableReplaced, d.cfg.Schema, d.cfg.Table, id.OID, oid, d.commitLSN, at, d.cfg.Schema, d.cfg.Table, at)
}

func (d *Decoder) decodeInsert(src []byte) (Message, error) {
	if len(src) < 7 {
		return Message{}, fmt.Errorf("%w: insert message of %d bytes", ErrProtocol, len(src))
	}
	relID := binary.BigEndian.Uint32(src)
	if src[4] != 'N' {
		return Message{}, fmt.Errorf("%w: insert tuple type %q, want 'N'", ErrProtocol, src[4])
	}
	rel, ok := d.relations[relID]
	if !ok {
		return Message{}, fmt.Errorf("%w: insert for relation %d before its Relation message", ErrProtocol, relID)
	}
	if !d.inTxn {
		return Message{}, fmt.Errorf("%w: insert outside a transaction", ErrProtocol)
	}
	if !rel.outbox {
		if rel.unplaced {
			return Message{}, fmt.Errorf("%w: a row of %s (relation OID %d) in transaction %s: jetbox's publication publishes the partitioned outbox %s.%s and other tables, and %s has the outbox's columns but is no partition of it now; "+
				"fix: if %s was a partition of the outbox (detached or dropped since), make the publication publish the outbox alone (ALTER PUBLICATION ... SET TABLE %s.%s), after which jetbox reads every other table it streams as one of the outbox's partitions, and restart; if it is another table, give jetbox a publication of the outbox alone and run jetbox repair",
				ErrUnplacedTable, rel.name, relID, d.commitLSN, d.cfg.Schema, d.cfg.Table, rel.name, rel.name, d.cfg.Schema, d.cfg.Table)
		}
		return Message{}, nil
	}
	index := d.index
	d.index++
	cols, err := splitTuple(d.cols[:0], src[5:], rel.ncols)
	if err != nil {
		return Message{}, err
	}
	d.cols = cols // reused: the columns alias data, read only during Decode
	ev := Event{CommitLSN: d.commitLSN, CommitTime: d.commitTime, TxIndex: index, XID: d.xid, Origin: d.origin}
	msg := Message{Kind: KindEvent}
	if rel.partition && !rel.named {
		msg.Partition, rel.named = rel.name, true
	}
	if err := rel.fill(&ev, cols, &d.cfg); err != nil {
		err.LSN, err.TxIndex = d.commitLSN, index
		if d.cfg.DeadLetterSubject == "" || !err.DeadLetterable() {
			return Message{}, err
		}
		msg.Event = d.cfg.DeadLetter(&ev, err)
		return msg, nil
	}
	msg.Event = ev
	return msg, nil
}

// column is one tuple column; data aliases the message buffer.
type column struct {
	kind byte // 'n' null, 'u' unchanged toast, 't' text, 'b' binary
	data []byte
}

// splitTuple parses TupleData with bounds checks, without copying, into
// buf's storage when it is large enough.
func splitTuple(buf []column, src []byte, want int) ([]column, error) {
	if len(src) < 2 {
		return nil, fmt.Errorf("%w: tuple too short", ErrProtocol)
	}
	n := int(binary.BigEndian.Uint16(src))
	if n != want {
		return nil, fmt.Errorf("%w: tuple has %d columns, relation has %d", ErrProtocol, n, want)
	}
	if cap(buf) < n {
		buf = make([]column, n)
	}
	cols := buf[:n]
	p := 2
	for i := 0; i < n; i++ {
		if p >= len(src) {
			return nil, fmt.Errorf("%w: tuple truncated at column %d", ErrProtocol, i)
		}
		kind := src[p]
		p++
		cols[i] = column{kind: kind}
		switch kind {
		case 'n', 'u':
		case 't', 'b':
			if len(src)-p < 4 {
				return nil, fmt.Errorf("%w: tuple truncated at column %d length", ErrProtocol, i)
			}
			l := int(binary.BigEndian.Uint32(src[p:]))
			p += 4
			if l < 0 || l > len(src)-p {
				return nil, fmt.Errorf("%w: column %d length %d exceeds message", ErrProtocol, i, l)
			}
			cols[i].data = src[p : p+l]
			p += l
		default:
			return nil, fmt.Errorf("%w: column %d has unknown kind %q", ErrProtocol, i, kind)
		}
	}
	return cols, nil
}
