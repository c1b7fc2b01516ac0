// Package delayproxy is a TCP relay that adds round-trip time: every chunk
// it reads from one side is written to the other side RTT/2 after it was
// read, in both directions, so a request/response exchange through it takes
// at least RTT longer than without it. It is the lab's stand-in for a long
// link (scripts/lab; the machines the lab runs on have no `tc netem`).
//
// Chunks are stamped when read and delivered in order, never reordered and
// never merged across the deadline of an earlier one. Buffering is bounded
// per direction (Config.BufferBytes, by default twice the bandwidth-delay
// product of a 1 Gbit/s link at the configured delay): when the far side
// does not keep up, the proxy stops reading and TCP pushes back on the
// sender, so the proxy never holds more than that many bytes per direction
// of a connection. A half-close (FIN) is relayed after the data before it.
package delayproxy
