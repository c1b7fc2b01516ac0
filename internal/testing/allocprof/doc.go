// Package allocprof measures the allocations made under one function while
// a piece of code runs, from the runtime's memory profile. It is for
// benchmarks that must report a library function's own cost without the
// allocations of the in-process fakes around it.
package allocprof
