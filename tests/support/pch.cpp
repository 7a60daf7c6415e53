// The host of the tests' precompiled headers (tests/CMakeLists.txt, ferry_test_pch): the
// headers themselves are the point, this file has nothing of its own.
