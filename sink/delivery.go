package sink

// Delivery is how jetbox delivers events into the stream: one of the four
// modes --delivery, --order-guard and --atomic-transactions select between
// (cmd/jetbox parses them once and refuses the other combinations). The
// zero value is Dedup.
//
// What each mode does (see the package doc and docs/guarantees.md):
//
//   - ExactlyOnce: jetbox is the stream's only writer. A session resumes
//     after the stream's last message and skips replays by position; every
//     publish expects the stream's last sequence (on an R1 stream also the
//     previous message's id).
//   - ExactlyOnceAtomic: ExactlyOnce with each transaction stored as
//     JetStream atomic batches (AtomicSession).
//   - DedupGuarded: a stream shared with other publishers; replays are
//     absorbed by Nats-Msg-Id dedup, publishes carry the expected last
//     sequence, and the watermark that tells a replay from a repeated id
//     is kept in WatermarkBucket.
//   - Dedup: DedupGuarded without the order guard: no expected sequence,
//     no watermark.
type Delivery int

// The delivery modes.
const (
	Dedup             Delivery = iota // --delivery=dedup --order-guard=false
	DedupGuarded                      // --delivery=dedup
	ExactlyOnce                       // --delivery=exactly-once (the default)
	ExactlyOnceAtomic                 // --delivery=exactly-once --atomic-transactions
)

// ExactlyOnce reports whether d resumes from the stream's last message and
// skips replays by position (jetbox is the stream's only writer).
func (d Delivery) ExactlyOnce() bool { return d == ExactlyOnce || d == ExactlyOnceAtomic }

// Atomic reports whether d stores each transaction as atomic batches.
func (d Delivery) Atomic() bool { return d == ExactlyOnceAtomic }

// Guarded reports whether d's publishes carry the order guard
// (Nats-Expected-Last-Sequence), so the stream holds this source's events
// in position order.
func (d Delivery) Guarded() bool { return d != Dedup }

// PersistsWatermark reports whether d keeps its watermark in
// WatermarkBucket: dedup with the order guard (exactly-once resumes from
// the stream's last message instead; without the guard positions prove
// nothing).
func (d Delivery) PersistsWatermark() bool { return d == DedupGuarded }

// Flag is d's --delivery value: exactly-once or dedup.
func (d Delivery) Flag() string {
	if d.ExactlyOnce() {
		return "exactly-once"
	}
	return "dedup"
}

// String names d as its flags do.
func (d Delivery) String() string {
	switch d {
	case Dedup:
		return "dedup without the order guard"
	case DedupGuarded:
		return "dedup"
	case ExactlyOnce:
		return "exactly-once"
	case ExactlyOnceAtomic:
		return "exactly-once with atomic transactions"
	}
	return "unknown delivery mode"
}
