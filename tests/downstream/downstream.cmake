# Registered by tests/CMakeLists.txt: the find_package(ferry) check on an installed tree.
