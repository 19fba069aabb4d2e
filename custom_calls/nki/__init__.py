"""lrjax.custom_calls.nki"""
