package decoder

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"
)

// Origin is the WAL history an event comes from, as Jetbox-Source carries
// it: the cluster (its system identifier), the timeline, the database and
// the slot. Positions (Jetbox-Commit-LSN, Jetbox-Tx-Index) compare only
// between events of one writer (the same system, database and slot); the
// timeline says which branch of its WAL.
type Origin struct {
	SystemID string
	Timeline int32
	Database string
	Slot     string
}

// String encodes o as "<system id>/<timeline>/<database>/<slot>", with the
// database and slot path-escaped (a database name may hold '/'): the same
// text as before escaping for every name without '/', '%' or characters a
// URL path escapes.
func (o Origin) String() string {
	return fmt.Sprintf("%s/%d/%s/%s", o.SystemID, o.Timeline, url.PathEscape(o.Database), url.PathEscape(o.Slot))
}

// ParseOrigin parses a Jetbox-Source value; ok is false for any other text.
func ParseOrigin(s string) (o Origin, ok bool) {
	parts := strings.Split(s, "/")
	if len(parts) != 4 || parts[0] == "" {
		return Origin{}, false
	}
	tl, err := strconv.ParseInt(parts[1], 10, 32)
	if err != nil {
		return Origin{}, false
	}
	db, err1 := url.PathUnescape(parts[2])
	slot, err2 := url.PathUnescape(parts[3])
	if err1 != nil || err2 != nil {
		return Origin{}, false
	}
	return Origin{SystemID: parts[0], Timeline: int32(tl), Database: db, Slot: slot}, true
}

// Writer is o without its timeline: the system, database and slot whose
// positions compare (a failover keeps the writer).
func (o Origin) Writer() string { return o.SystemID + "/" + o.Database + "/" + o.Slot }

// SameWriter reports whether two Jetbox-Source values name the same system,
// database and slot, whatever their timelines. A value that does not parse
// is only its own writer.
func SameWriter(a, b string) bool {
	oa, oka := ParseOrigin(a)
	ob, okb := ParseOrigin(b)
	if !oka || !okb {
		return a == b
	}
	return oa.Writer() == ob.Writer()
}
